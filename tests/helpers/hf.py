"""Tiny transformers MoE model folders for the tests, built offline, and the config of a
short run of one.

``tiny_hf_model_dir(tmp_path, family)`` writes what a user's model folder holds: a random
model of the family built from its config class and saved with ``save_pretrained``
(config.json, safetensors), and a small byte-level BPE tokenizer trained in memory with the
``tokenizers`` library, wrapped in ``PreTrainedTokenizerFast`` with EOS and pad tokens and
saved into the same folder. The model's EOS id is the tokenizer's, so documents split as
the tokenizer marks them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moestack.config import (
    DataConfig,
    HFModelConfig,
    OptimConfig,
    RouterConfig,
    TelemetryConfig,
    TrainConfig,
)

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
EOS, PAD = "<|endoftext|>", "<pad>"
VOCAB = 320  # the model's vocabulary: at least the tokenizer's (about 300 tokens)

_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "def forward(self, x):\n    return self.proj(x) + x\n",
    "Mixture-of-experts layers route each token to a few experts.",
    "An expert cache keeps the most recently used experts in fast memory.",
    "for i in range(10):\n    print(i * i)\n",
]


def tiny_tokenizer(save_dir: Path | None = None) -> Any:
    """A byte-level BPE tokenizer trained in memory on a few lines (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TEXT * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)
    assert len(fast) <= VOCAB
    if save_dir is not None:
        fast.save_pretrained(save_dir)
    return fast


def tiny_config(family: str, eos_id: int, pad_id: int, **overrides: Any) -> Any:
    """A tiny config of ``family``: 2 layers, d_model 32, 4 heads, 6 experts, top-2."""
    from transformers import AutoConfig

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_experts_per_tok=2,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    family_kwargs: dict[str, dict[str, Any]] = {
        "qwen3_moe": dict(
            num_experts=6,
            moe_intermediate_size=16,
            intermediate_size=48,
            head_dim=8,
            norm_topk_prob=True,
        ),
        "qwen2_moe": dict(
            num_experts=6,
            moe_intermediate_size=16,
            intermediate_size=48,
            shared_expert_intermediate_size=24,
            norm_topk_prob=False,
        ),
        "mixtral": dict(num_local_experts=6, intermediate_size=16),
        "olmoe": dict(num_experts=6, intermediate_size=16, norm_topk_prob=False),
    }
    return AutoConfig.for_model(family, **{**common, **family_kwargs[family], **overrides})


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that routing differs between tokens (transformers' init leaves
    the routers at zero, where every token would tie)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def tiny_hf_model_dir(
    tmp_path: Path, family: str, seed: int = 0, *, max_shard_size: str | None = None, **overrides
) -> Path:
    """``tmp_path/family``: a random tiny ``family`` model and its tokenizer, saved."""
    from transformers import AutoModelForCausalLM

    out = Path(tmp_path) / family
    tok = tiny_tokenizer(out)
    config = tiny_config(family, tok.eos_token_id, tok.pad_token_id, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    randomize(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return out


def sample_tokens(eos_id: int, batch: int = 2, seq: int = 24, seed: int = 0) -> torch.Tensor:
    """Random tokens with an EOS in each row, so every row holds two documents."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, VOCAB, (batch, seq), generator=gen)
    tokens[:, seq // 3] = eos_id
    return tokens


def reference_model(path: Path) -> torch.nn.Module:
    """transformers' own (unpatched) model from ``path`` in fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)


def hf_config(path: Path, tmp_path: Path, **overrides: Any) -> TrainConfig:
    """A 20-step run of the model folder ``path`` (routers only, temporal and anchor losses),
    its out_dir under ``tmp_path``; ``overrides`` replace its fields."""
    base = dict(
        model=HFModelConfig(path=str(path), moe={"impl": "torch"}),
        router=RouterConfig(load_balance=0.0, z_loss=0.0, temporal=0.3, anchor=0.1),
        trainable="routers",
        optim=OptimConfig(lr=3e-2, warmup_steps=1, weight_decay=0.0),
        data=DataConfig(seq_len=32, max_bytes=300_000),
        telemetry=TelemetryConfig(enabled=False),
        steps=20,
        batch_size=4,
        eval_every=0,
        eval_batches=2,
        log_every=5,
        ckpt_every=10,
        progress=False,
        wandb_mode="disabled",
        threads=1,
        out_dir=str(tmp_path / "run"),
    )
    base.update(overrides)
    return TrainConfig(**base).resolve()  # the folder's architecture, as a run reads it
