"""Peak host memory of a transformers MoE model loaded whole against loaded without its
routed experts (``load_hf_moe(DIR, experts=False)``), and of serving it from the cache.

A random Qwen3-MoE-architecture folder is written once (``--layers``, ``--experts``,
``--d-model``, ``--d-ff``; fp32 safetensors). Each contender then runs in a fresh Python
process that reports its peak memory above where the process stood after its imports
(Linux): the anonymous resident set (RssAnon, sampled every millisecond: memory the process
owns) and the whole resident set (the high-water mark VmHWM, reset through
``/proc/self/clear_refs``; it also counts pages of the memory-mapped safetensors, which the
kernel can drop), and the bytes of the model's tensors that hold memory (counted):

- ``import``: nothing more (the measure's floor);
- ``whole``: ``load_hf_moe(DIR)`` (transformers' ``from_pretrained``, then patched);
- ``without_experts``: ``load_hf_moe(DIR, experts=False)``;
- ``served``: the same, then the expert store written from the folder one layer at a time
  and one forward pass of ``--tokens`` tokens with the experts served by an LRU cache of
  2 x top_k experts per layer (what ``moestack eval DIR --offload`` does).

The contenders run one after another on the same folder; the ratios are to ``whole``. Each
starts a fresh interpreter, or with ``--start-method forkserver`` is forked from one server
process that imported their modules (torch, transformers, moestack) once: at a toy size,
those imports are most of the run's time.

    python scripts/bench_hf_offload.py [--layers 8 --experts 32] [--json out.json]
        [--start-method spawn]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.forkserver
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

CONTENDERS = ("import", "whole", "without_experts", "served")
# What measure() imports before it measures (the fork server's preload).
CHILD_MODULES = (
    "torch", "transformers.models.qwen3_moe.modeling_qwen3_moe", "moestack.cache",
    "moestack.cache.policies", "moestack.config", "moestack.interop.hf_experts",
    "moestack.interop.hf_model",
)  # fmt: skip


def write_folder(root: Path, args: argparse.Namespace) -> Path:
    """A random Qwen3-MoE folder (config.json, model.safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.d_model // 8,
        intermediate_size=4 * args.d_model,
        moe_intermediate_size=args.d_ff,
        num_experts=args.experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    out = root / "model"
    model.save_pretrained(out)
    return out


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM, RssAnon) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"/proc/self/status has no {field}: this benchmark needs Linux")


class AnonPeak:
    """The largest anonymous resident set (RssAnon: memory the process owns, as opposed to
    pages of memory-mapped files, which the kernel can drop) seen every millisecond."""

    def __init__(self) -> None:
        self.peak = _status_bytes("RssAnon")
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, _status_bytes("RssAnon"))

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(self.peak, _status_bytes("RssAnon"))


def measure(contender: str, folder: str, store: str, tokens: int) -> dict:
    """Run one contender in this (fresh) process: its peak resident set (all of it: VmHWM,
    reset after the imports through Linux ``clear_refs`` 5; and the anonymous part, sampled)
    above where it stood after the imports, and the bytes of the model's tensors that hold
    memory."""
    import torch
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401 (imported lazily)

    from moestack.cache import ExpertStore, evaluate_offloaded
    from moestack.cache.policies import default_capacity
    from moestack.config import CacheConfig
    from moestack.interop.hf_experts import iter_hf_expert_layers
    from moestack.interop.hf_model import load_hf_moe

    Path("/proc/self/clear_refs").write_text("5")
    start_rss, start_anon = _status_bytes("VmRSS"), _status_bytes("RssAnon")
    anon = AnonPeak()
    model_bytes = cache_bytes = 0
    if contender != "import":
        model = load_hf_moe(folder, experts=contender == "whole")
        seen = {id(t): t for t in (*model.parameters(), *model.buffers()) if not t.is_meta}
        model_bytes = sum(t.numel() * t.element_size() for t in seen.values())
    if contender == "served":
        written = ExpertStore.write_layers(
            iter_hf_expert_layers(folder), store, model_cfg=model.cfg, overwrite=True
        )
        gen = torch.Generator().manual_seed(0)
        seq = 128
        rows = max(tokens // seq, 1)
        batch = torch.randint(0, model.cfg.vocab_size, (rows, seq + 1), generator=gen)
        batches = [(batch[:, :-1], batch[:, 1:])]
        cache = CacheConfig(policy="lru")  # capacity 2 x top_k experts per layer
        evaluate_offloaded(model, written, batches, "cpu", cache)
        capacity = default_capacity(model.cfg.moe.top_k) * written.num_layers
        cache_bytes = capacity * written.expert_bytes
        written.close()
    return {
        "contender": contender,
        "peak_rss_bytes": _status_bytes("VmHWM") - start_rss,
        "peak_anon_bytes": anon.stop() - start_anon,
        "model_bytes": model_bytes,
        "cache_bytes": cache_bytes,
    }


def run_contender(contender: str, folder: Path, store: Path, tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--child", contender, str(folder), str(store), str(tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{contender} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start_fork_server() -> None:
    """Start the server the contenders fork from: it imports CHILD_MODULES (while this
    process writes the folder)."""
    multiprocessing.set_forkserver_preload(["__main__", *CHILD_MODULES])
    multiprocessing.forkserver.ensure_running()


def fork_contenders(folder: Path, store: Path, tokens: int) -> list[dict]:
    """Each contender in a fresh process forked from the server, one after another."""
    ctx = multiprocessing.get_context("forkserver")
    rows = []
    for contender in CONTENDERS:
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:  # one process, one contender
            rows.append(pool.submit(measure, contender, str(folder), str(store), tokens).result())
    return rows


def print_table(rows: list[dict], folder_bytes: int) -> None:
    whole = next(r for r in rows if r["contender"] == "whole")
    print(f"model folder: {folder_bytes / 2**20:.1f} MiB of safetensors")
    head = f"{'contender':<18}{'anon MiB':>10}{'x whole':>9}{'RSS MiB':>10}{'x whole':>9}"
    print(head + f"{'model MiB':>11}{'cache MiB':>11}")
    for r in rows:
        anon, rss = r["peak_anon_bytes"], r["peak_rss_bytes"]
        print(
            f"{r['contender']:<18}{anon / 2**20:>10.1f}{anon / whole['peak_anon_bytes']:>9.2f}"
            f"{rss / 2**20:>10.1f}{rss / whole['peak_rss_bytes']:>9.2f}"
            f"{r['model_bytes'] / 2**20:>11.1f}{r['cache_bytes'] / 2**20:>11.1f}"
        )
    print(
        "peaks above the process after its imports: anon = memory the process owns (sampled "
        "every ms), RSS = that plus mapped file pages; model = the model's tensors, cache = the full "
        "cache's experts (counted)"
    )


def main() -> None:
    from moestack import bench  # lazily: a contender's process measures from its own imports

    parser = bench.parser(__doc__, json="")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-ff", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the served pass")
    parser.add_argument("--dir", default="", help="scratch directory (default: a temp dir)")
    parser.add_argument(
        "--start-method", default="spawn", choices=("spawn", "forkserver"),
        help="how each contender's process starts (default spawn: a fresh interpreter that "
        "imports everything itself; forkserver: forked from one server that imported the "
        "contenders' modules once)",
    )  # fmt: skip
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        contender, folder, store, tokens = args.child
        print(json.dumps(measure(contender, folder, store, int(tokens))))
        return
    root = Path(tempfile.mkdtemp(prefix="bench_hf_offload.", dir=args.dir or None))
    if args.start_method == "forkserver":
        start_fork_server()
    try:
        folder = write_folder(root, args)
        folder_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        if args.start_method == "forkserver":
            rows = fork_contenders(folder, root / "store", args.tokens)
        else:
            rows = [run_contender(c, folder, root / "store", args.tokens) for c in CONTENDERS]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(rows, folder_bytes)
    if args.json:
        out = {"rows": rows, "folder_bytes": folder_bytes, "args": vars(args)}
        bench.write_json(args.json, out)


if __name__ == "__main__":
    main()
