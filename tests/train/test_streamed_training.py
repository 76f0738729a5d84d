"""offload_experts through the training loop (moestack.trainer.train): 20 steps of
trainable=lora and of routers with the experts streamed from the store on disk give the
resident run's losses and trained weights bit for bit, and log the cache's traffic."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers.runs import losses, small_config

from moestack.cache.expert_cache import CacheConfig
from moestack.lora import LoRAConfig
from moestack.metrics import read_metrics
from moestack.trainer import train


@pytest.mark.parametrize("trainable", ["lora", "routers"])
def test_streamed_from_disk_equals_resident(tmp_path: Path, trainable: str) -> None:
    def cfg(offload: str):  # noqa: ANN202
        return small_config(trainable=trainable, lora=LoRAConfig(rank=4), steps=20,
                            ckpt_every=20, offload_experts=offload,
                            cache=CacheConfig(capacity=2))  # fmt: skip

    train(cfg("off"), tmp_path / "resident")
    train(cfg("disk"), tmp_path / "disk")
    assert losses(tmp_path / "disk") == losses(tmp_path / "resident")
    a = safetensors.torch.load_file(tmp_path / "resident/checkpoints/step_000020/model.safetensors")
    b = safetensors.torch.load_file(tmp_path / "disk/checkpoints/step_000020/model.safetensors")
    trained = [n for n in b if "lora" in n or "router" in n]
    assert trained and all(torch.equal(a[n], b[n]) for n in trained)
    assert not any(n.endswith(("moe.w1", "moe.w2")) for n in b)  # the store holds them
    assert (tmp_path / "disk/experts").is_dir()
    record = [r for r in read_metrics(tmp_path / "disk/metrics.jsonl") if "cache/loads" in r]
    assert len(record) == 20 and all(r["cache/loads"] > 0 for r in record)
    assert all(0 <= r["cache/hit_rate"] <= 1 for r in record)


def test_a_streamed_run_never_holds_its_experts(tmp_path: Path) -> None:
    """Counted in bytes (every tensor storage the run makes, alive at once): the resident
    run holds all 8 layers' experts; the streamed one never does (one layer's while it
    writes the store, 1/8 of them, and the cache's 2 slots of 16 per layer, 1/8 more),
    so its peak, everything else included, stays under 80% of the experts' bytes."""
    from helpers.alloc import PeakAllocated

    from moestack.model import ModelConfig
    from moestack.moe import MoEConfig

    model = ModelConfig(vocab_size=256, d_model=64, n_layers=8, n_heads=2, max_seq_len=32,
                        moe=MoEConfig(num_experts=16, top_k=2, d_ff=256))  # fmt: skip
    experts = 8 * 16 * (64 * 512 + 256 * 64) * 4  # w1 [D, 2F] and w2 [F, D] in fp32

    def peak(offload: str) -> int:
        cfg = small_config(model=model, trainable="lora", lora=LoRAConfig(rank=2), steps=2,
                           ckpt_every=0, offload_experts=offload, cache=CacheConfig(capacity=2))  # fmt: skip
        with PeakAllocated() as counted:
            train(cfg, tmp_path / offload)
        return counted.peak

    resident, streamed = peak("off"), peak("disk")
    assert resident >= experts  # the resident build holds every expert at once
    assert streamed < 0.8 * experts  # a build with every expert, released later, fails here
