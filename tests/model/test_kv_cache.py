"""The model's KV cache: a cached decode gives the full forward's logits at every position,
greedy generation through it gives the tokens of re-running the sequence at every step, and
an offloaded model then requests exactly top_k experts per layer per decode step."""

from __future__ import annotations

import pytest
import torch
from helpers.cache import tiny_model

from moestack import ModelConfig, MoEConfig, MoETransformer
from moestack.cache import ExpertCache, ExpertStore, generate_offloaded
from moestack.evaluation import greedy_generate

CPU = torch.device("cpu")


def small_model(
    impl: str = "torch",
    dtype: torch.dtype = torch.float64,
    max_seq_len: int = 24,
    seed: int = 0,
    init_std: float = 0.02,
) -> MoETransformer:
    cfg = ModelConfig(
        d_model=32,
        n_layers=2,
        n_heads=4,
        max_seq_len=max_seq_len,
        init_std=init_std,
        tie_embeddings=False,  # tied, a random model repeats its input token
        moe=MoEConfig(num_experts=6, top_k=2, d_ff=16, impl=impl),
    )
    model = MoETransformer(cfg, seed=seed).to(dtype).eval()
    with torch.no_grad():  # spread the router logits: routing far from ties
        for moe in model.moe_layers:
            moe.router.weight.mul_(20.0)
    return model


def random_tokens(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (batch, seq), generator=gen)


def cached_logits(model: MoETransformer, tokens: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits of ``tokens`` fed through one cache in pieces of ``chunks`` tokens."""
    cache = model.new_kv_cache(tokens.shape[0])
    out, start = [], 0
    with torch.no_grad():
        for size in chunks:
            out.append(model(tokens[:, start : start + size], cache=cache).logits)
            start += size
            assert cache.length == start
            assert cache.keys[0].shape == (tokens.shape[0], 4, start, 8)
    assert start == tokens.shape[1]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize(
    ("impl", "dtype", "tol"),
    [
        ("torch", torch.float64, 1e-12),
        ("torch", torch.float32, 1e-5),
        ("triton", torch.float32, 1e-5),
    ],
)
@pytest.mark.parametrize("chunks", [[5, 1, 1, 3, 1, 1], [1] * 12, [12]])
def test_cached_decode_gives_the_full_forwards_logits(impl, dtype, tol, chunks):
    model = small_model(impl, dtype)
    tokens = random_tokens(2, 12)
    with torch.no_grad():
        full = model(tokens).logits
    got = cached_logits(model, tokens, chunks)
    torch.testing.assert_close(got, full, atol=tol, rtol=tol)
    if chunks[0] == 12:  # an empty cache runs the prompt as the plain forward does
        assert torch.equal(got, full)


def test_cache_refuses_past_max_seq_len_and_a_mismatched_batch():
    model = small_model(max_seq_len=8)
    cache = model.new_kv_cache(1)
    with torch.no_grad():
        model(random_tokens(1, 6), cache=cache)
        with pytest.raises(ValueError, match=r"length 6 \+ 3 new tokens exceeds .*max_seq_len=8"):
            model(random_tokens(1, 3), cache=cache)
        assert cache.length == 6  # nothing appended by the refused call
        assert cache.keys[1].shape[2] == 6
        with pytest.raises(ValueError, match=r"new_kv_cache\(2\)"):
            model(random_tokens(2, 1), cache=cache)
        model(random_tokens(1, 2), cache=cache)  # up to max_seq_len is fine
    assert cache.length == 8


def reference_generate(model: MoETransformer, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding without a cache: the whole sequence (its last max_seq_len tokens)
    re-run at every step."""
    tokens = torch.tensor([prompt])
    max_len = model.cfg.max_seq_len
    with torch.no_grad():
        for _ in range(n):
            nxt = model(tokens[:, -max_len:]).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[0, len(prompt) :].tolist()


def forward_lengths(model: MoETransformer) -> tuple[list[int], object]:
    """The token counts of every forward call of ``model`` (and the hook's handle)."""
    seen: list[int] = []
    handle = model.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    return seen, handle


@pytest.mark.parametrize(
    ("prompt_len", "new", "expected_calls"),
    [
        (1, 10, [1] + [1] * 9),  # one-token prompt
        (9, 8, [9] + [1] * 7),  # longer prompt, within max_seq_len=16
        (10, 12, [10] + [1] * 6 + [16] * 5),  # crosses max_seq_len: windows of 16 after it
        (20, 3, [16, 16, 16]),  # a prompt longer than max_seq_len: windows throughout
    ],
)
def test_greedy_generate_equals_rerunning_the_sequence(prompt_len, new, expected_calls):
    model = small_model(max_seq_len=16, seed=3, init_std=0.3)  # attention far from uniform
    prompt = random_tokens(1, prompt_len, seed=prompt_len)[0].tolist()
    want = reference_generate(model, prompt, new)
    seen, handle = forward_lengths(model)
    try:
        got = greedy_generate(model, prompt, new, CPU)
    finally:
        handle.remove()
    assert got == want
    assert seen == expected_calls  # prefill once, then one token per forward
    assert len(set(want)) >= new // 2  # not a degenerate repetition


@pytest.mark.parametrize("prefetch", [False, True])
def test_offloaded_generation_requests_top_k_experts_per_layer_per_step(tmp_path, prefetch):
    prompt = [5, 17, 99, 3, 250, 42]
    new = 8
    want = reference_generate(tiny_model(), prompt, new)
    store = ExpertStore.write(tiny_model(), tmp_path / "store")
    model = tiny_model()
    top_k, n_layers = model.cfg.moe.top_k, model.cfg.n_layers
    cache = ExpertCache(store, 3, "lru", prefetch=prefetch, record=True)
    served: list[tuple[int, int]] = []
    serve = cache.serve

    def counting_serve(layer: int, experts: list[int]):
        served.append((layer, len(experts)))
        return serve(layer, experts)

    cache.serve = counting_serve
    try:
        out = generate_offloaded(model, cache, prompt, new, CPU)
    finally:
        cache.close()
    assert out["tokens"] == want
    # the prompt once, then the new tokens but the last one, one at a time
    per_step = [len(prompt) * top_k] + [top_k] * (new - 1)
    assert served == [(layer, n) for n in per_step for layer in range(n_layers)]
    for layer in range(n_layers):
        assert len(cache.access_log(layer)) == sum(per_step)
    assert out["cache/requests"] == n_layers * sum(per_step)
