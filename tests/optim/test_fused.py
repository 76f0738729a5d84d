"""The fused host step: backends against the formula bitwise, OffloadAdamW against torch AdamW
with bf16 weights, and the fallback to the reference path when no kernel can be built.

Compiled-path tests use small slices and one or two dtype combinations: each combination is
one torch.compile compilation (seconds, cached on disk by inductor afterwards).
"""

from __future__ import annotations

import io
import logging
import platform

import pytest
import torch
from _optim_testlib import (
    ACCUM,
    IDLE,
    LR,
    MAX_NORM,
    STEPS,
    TinyMoE,
    assert_rel_close,
    batch,
    groups,
    lr_lambda,
    ours_state,
)
from helpers.native_kernel import native_kernel

from moestack.kernels import host_adamw, host_build
from moestack.kernels.host_adamw import Seg
from moestack.optim import OffloadAdamW, fused

BF16_COMBO = (torch.bfloat16, torch.float32, torch.bfloat16)  # bf16 weights, fp32 moments
HP = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1, "eps": 1e-8}


@pytest.fixture
def fresh_backends(monkeypatch):
    """Forget which backends this process resolved, and which lines it logged."""
    monkeypatch.setattr(fused, "_STATE", {})
    monkeypatch.setattr(fused, "_WARNED", set())


def _segments(combo, sizes, seed=0):
    """Random slices of ``combo``'s dtypes, one per size; the coefficients differ per slice."""
    gen = torch.Generator().manual_seed(seed)
    segs = []
    for k, n in enumerate(sizes):
        base = [torch.randn(n, generator=gen) for _ in range(3)]
        base.append(torch.rand(n, generator=gen) * 1e-2)
        segs.append(host_adamw._seg_of(base, combo, host_adamw.coefficients(HP, k + 1, 0.7)))
    return segs


def _assert_same(want, got):
    for a, b in zip(want, got, strict=True):
        for x, y in zip(a, b, strict=True):
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y)


def _native_kernel():
    """Skips only without a C++ compiler; a compiler and no kernel fails (helpers)."""
    return native_kernel()


@pytest.mark.parametrize("combo", host_adamw.ALL_COMBOS, ids=str)
def test_native_kernel_matches_the_formula_bitwise(combo) -> None:
    """Tails, several slices in one call, and more elements than one thread takes."""
    kernel = _native_kernel()
    sizes = [1, 15, 67, 40_000, 0, 33]
    want, got = _segments(combo, sizes), _segments(combo, sizes)
    host_adamw.eager_kernel(want)
    kernel(got)
    _assert_same(want, got)
    for s in got:
        if s.out is not None:  # the narrowed weight is the master's .to(dtype), bit for bit
            assert torch.equal(s.out, s.x.to(s.out.dtype))


def test_native_kernel_splits_over_threads_exactly() -> None:
    """1 thread and several equal the formula: the 64K-element chunks dealt to the threads
    cross slices, start on slice boundaries, skip empty slices and end in a short chunk."""
    kernel = _native_kernel()
    chunk = 1 << 16
    gen = torch.Generator().manual_seed(3)
    small = torch.randint(1, 900, (300,), generator=gen).tolist()  # many slices in one chunk
    sizes = [70_001, 0, 12_345, chunk - 82_346 % chunk, chunk, 0, *small, 50_000, 1]
    want = _segments(BF16_COMBO, sizes, seed=1)
    host_adamw.eager_kernel(want)
    threads = torch.get_num_threads()
    for nt in (1, max(2, threads)):
        torch.set_num_threads(nt)
        try:
            got = _segments(BF16_COMBO, sizes, seed=1)
            kernel(got)
        finally:
            torch.set_num_threads(threads)
        _assert_same(want, got)


def test_prepared_segments_take_new_coefficients() -> None:
    """A prepared call steps with the coefficients it is given, and checks their count."""
    kernel = _native_kernel()
    want, got = _segments(BF16_COMBO, [5, 100], seed=2), _segments(BF16_COMBO, [5, 100], seed=2)
    prepared = kernel.prepare(got)
    other = [seg._replace(coef=host_adamw.coefficients(HP, 7, 0.3)) for seg in want]
    host_adamw.eager_kernel(other)
    kernel.run(prepared, [seg.coef for seg in other])
    _assert_same(other, got)
    with pytest.raises(ValueError, match="coefficient"):
        kernel.run(prepared, [other[0].coef])
    with pytest.raises(ValueError, match="8 coefficients"):
        kernel.run(prepared, [other[0].coef, other[1].coef[:7]])


def test_fused_step_reads_each_steps_new_gradients() -> None:
    """The direct fused step reuses its prepared slices only while the gradients stay where
    they are: new ``.grad`` tensors each step (one of them not contiguous) against torch
    AdamW on copies."""
    gen = torch.Generator().manual_seed(4)
    shapes = [(33, 17), (5,), (70_000,)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    _native_kernel()
    opt = OffloadAdamW(ours, lr=1e-2, weight_decay=0.1, in_place=False, fused_step="native")
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for step in range(4):
        for a, b in zip(ours, ref, strict=True):
            g = torch.randn(a.shape[::-1], generator=gen).T if a.dim() == 2 and step == 2 else None
            g = torch.randn(a.shape, generator=gen) if g is None else g
            a.grad, b.grad = g, g.contiguous().clone()
        opt.step()
        torch_opt.step()
    assert opt.host_step == "native"
    for a, b in zip(ours, ref, strict=True):
        assert_rel_close(a.detach(), b.detach(), "weights", 1e-6)


def test_native_kernel_refuses_what_it_cannot_take() -> None:
    kernel = _native_kernel()
    seg = _segments(BF16_COMBO, [8])[0]
    with pytest.raises(ValueError, match="segment"):
        kernel([seg._replace(g=torch.zeros(8, dtype=torch.float16))])
    with pytest.raises(ValueError, match="segment"):
        kernel([seg._replace(m=torch.zeros(16)[::2])])


def test_compiled_kernel_matches_the_formula_bitwise() -> None:
    kernel = fused.resolve("compile", [BF16_COMBO])
    assert kernel is not None and fused.kernel_name(kernel) == "compile"
    sizes = [5, 67, 1000]  # the first is below the compiled minimum: the eager formula
    want, got = _segments(BF16_COMBO, sizes), _segments(BF16_COMBO, sizes)
    host_adamw.eager_kernel(want)
    kernel(got)
    _assert_same(want, got)


def micro_step(model: torch.nn.Module, step: int) -> None:
    """Forward/backward of ACCUM micro-batches through a bf16 model (loss in fp32)."""
    for micro in range(ACCUM):
        x, y = batch(step, micro)
        loss = (model(x.bfloat16()).float() - y).square().mean() / ACCUM
        loss.backward()


def _bf16_run(**kw) -> None:
    """OffloadAdamW on a bf16 TinyMoE and torch AdamW on fp32 copies fed the same gradients:
    20 steps with a schedule, clipping, accumulation, an idle expert and a resume at 10."""
    model = TinyMoE().to(torch.bfloat16)
    names = dict(model.named_parameters())
    ref = {n: torch.nn.Parameter(p.detach().float()) for n, p in names.items()}
    ref_groups = [{**g, "params": [ref[n] for n, _ in g["params"]]} for g in groups(model)]
    ref_opt = torch.optim.AdamW(ref_groups, lr=LR, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lr_lambda)

    def build() -> OffloadAdamW:
        return OffloadAdamW(groups(model), lr=LR, betas=(0.9, 0.95), eps=1e-8, **kw)

    opt = build()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    for step in range(STEPS):
        if step == STEPS // 2:  # checkpoint through bytes, fresh optimizer
            buf = io.BytesIO()
            torch.save({"optim": opt.state_dict(), "sched": sched.state_dict()}, buf)
            buf.seek(0)
            ckpt = torch.load(buf, weights_only=True)
            opt = build()
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            sched.load_state_dict(ckpt["sched"])
            opt.load_state_dict(ckpt["optim"])
        micro_step(model, step)
        assert names["moe.w1"].grad[IDLE].abs().max() == 0
        for n, r in ref.items():
            r.grad = names[n].grad.float()
        norm = float(opt.clip_grad_norm_(MAX_NORM))
        ref_norm = float(torch.nn.utils.clip_grad_norm_(list(ref.values()), MAX_NORM))
        assert norm == pytest.approx(ref_norm, rel=1e-6) and norm > MAX_NORM
        for o, s in ((opt, sched), (ref_opt, ref_sched)):
            o.step()
            s.step()
            o.zero_grad()
        sd = opt.state_dict()
        for n, p in names.items():
            master = ours_state(sd, n, "master").reshape(p.shape)
            assert_rel_close(master, ref[n].detach(), f"step {step} master {n}", 1e-6)
            for key in ("exp_avg", "exp_avg_sq"):
                got = ours_state(sd, n, key).reshape(p.shape)
                want = ref_opt.state[ref[n]][key]
                assert_rel_close(got, want, f"step {step} {key} {n}", 1e-6)
            assert torch.equal(p.detach(), master.to(torch.bfloat16)), (step, n)
    assert opt.host_step == kw.get("fused_step", "auto")


@pytest.mark.parametrize("backend", ["native", "compile"])
def test_fused_step_matches_torch_adamw_with_bf16_weights(backend: str) -> None:
    if backend == "native":
        _native_kernel()
    _bf16_run(fused_step=backend)


def test_reference_path_matches_torch_adamw_with_bf16_weights() -> None:
    _bf16_run(fused_step="off")


def test_direct_mode_needs_no_gradient_buffer() -> None:
    """One process, CPU weights: the fused step reads .grad and writes the weights itself."""
    _native_kernel()
    model = TinyMoE().to(torch.bfloat16)
    opt = OffloadAdamW(model.named_parameters(), fused_step="native")
    micro_step(model, 0)
    opt.step()
    assert opt.host_step == "native"
    roles = set(opt.host_buffers())
    assert roles == {"master", "exp_avg", "exp_avg_sq"}  # 12 bytes per parameter, no 4 of grads


def test_bf16_moments_fused_step_tracks_the_reference_path() -> None:
    """bf16 moments: the fused step narrows them as the reference path does (nearest even);
    the two differ only by the rounding of the update itself."""
    _native_kernel()
    _, fused_weights = _losses_after(10, moment_dtype=torch.bfloat16, fused_step="native")
    _, ref_weights = _losses_after(10, moment_dtype=torch.bfloat16, fused_step="off")
    for n, w in fused_weights.items():
        assert_rel_close(w.float(), ref_weights[n].float(), n, 1e-2)


def test_clipping_twice_compounds_as_on_the_reference_path() -> None:
    """The fused step folds the clipping factor into its pass: a second clip sees the norm
    of the already scaled gradients, as it does when the host copy is scaled."""
    _native_kernel()
    results = {}
    for step_kind in ("native", "off"):
        model = TinyMoE().to(torch.bfloat16)
        opt = OffloadAdamW(groups(model), lr=LR, fused_step=step_kind)
        micro_step(model, 0)
        norms = [float(opt.clip_grad_norm_(MAX_NORM)), float(opt.clip_grad_norm_(MAX_NORM / 2))]
        opt.step()
        sd = opt.state_dict()
        names = [n for n, _ in model.named_parameters()]
        results[step_kind] = (norms, {n: ours_state(sd, n, "master") for n in names})
    (fused_norms, fused_w), (ref_norms, ref_w) = results["native"], results["off"]
    assert fused_norms == pytest.approx(ref_norms, rel=1e-5)
    assert fused_norms[1] == pytest.approx(MAX_NORM, rel=1e-4)  # the first clip's result
    for n, w in fused_w.items():  # the fp32 masters: the same update to rounding
        assert_rel_close(w, ref_w[n], n, 1e-6)


def _losses_after(steps: int, **kw) -> tuple[OffloadAdamW, dict]:
    model = TinyMoE().to(torch.bfloat16)
    opt = OffloadAdamW(groups(model), lr=LR, **kw)
    for step in range(steps):
        micro_step(model, step)
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
    return opt, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_no_kernel_falls_back_to_the_reference_path_with_one_line(
    monkeypatch, caplog, fresh_backends
) -> None:
    """Neither backend can be built (no C++ compiler, inductor fails): one logged warning,
    then the reference path, exactly."""

    def no_compile(*args, **kw):
        raise RuntimeError("inductor cannot build")

    monkeypatch.setattr(host_build, "find_compiler", lambda: None)
    monkeypatch.setattr(fused.torch, "compile", no_compile)
    with caplog.at_level(logging.INFO, logger="moestack.optim"):
        opt, weights = _losses_after(3, fused_step="auto")
        _losses_after(2, fused_step="auto")  # a second optimizer: nothing more is logged
    lines = [r for r in caplog.records if r.name == "moestack.optim.fused"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    msg = lines[0].getMessage()
    assert "native unavailable (RuntimeError: no C++ compiler" in msg
    assert "compile unavailable" in msg and "broken" not in msg
    assert "reference path" in msg and "\n" not in msg
    assert opt.host_step == "off"
    _, ref_weights = _losses_after(3, fused_step="off")
    for n, w in weights.items():
        assert torch.equal(w, ref_weights[n]), n


def test_native_failure_uses_the_compiled_step(monkeypatch, caplog, fresh_backends) -> None:
    def read_only_cache():
        raise OSError("read-only file system")

    monkeypatch.setattr(host_adamw, "load", read_only_cache)
    with caplog.at_level(logging.WARNING, logger="moestack.optim.fused"):
        kernel = fused.resolve("auto", [BF16_COMBO])
    assert fused.kernel_name(kernel) == "compile"
    (record,) = caplog.records
    assert "using compile" in record.getMessage() and "read-only" in record.getMessage()
    assert record.levelno == (logging.ERROR if host_build.find_compiler() else logging.WARNING)


def test_bad_fused_step_names_the_argument() -> None:
    with pytest.raises(ValueError, match="fused_step"):
        OffloadAdamW(TinyMoE().named_parameters(), fused_step="fast")


def test_segments_take_only_what_the_kernel_can() -> None:
    with pytest.raises(ValueError, match="segment"):
        host_adamw.check_seg(Seg(torch.zeros(3), torch.zeros(4), *[torch.zeros(3)] * 3, (0.0,) * 8))


# ------------------------------------------------------------------ the split master weight
@pytest.mark.parametrize("combo", host_adamw.SPLIT_COMBOS, ids=str)
def test_split_master_kernel_matches_the_formula_bitwise(combo) -> None:
    """bf16 weights plus int16 remainders: the kernel against the eager formula, over tails,
    several slices, chunks taken by two threads; the join equals the fp32-master step."""
    kernel = _native_kernel()
    sizes = [1, 15, 67, 70_000, 0, 33]

    def split_segments():
        return [
            s._replace(x=host_adamw.split_master(s.x, s.out))
            for s in _segments(combo, sizes, seed=5)
        ]

    want, got, plain = split_segments(), split_segments(), _segments(combo, sizes, seed=5)
    host_adamw.eager_kernel(want)
    kernel(got)
    _assert_same(want, got)
    start = [host_adamw.join_master(s.out, s.x) for s in split_segments()]
    plain = [s._replace(x=x) for s, x in zip(plain, start, strict=True)]
    kernel(plain)  # the same step on the fp32 master
    for p, s in zip(plain, got, strict=True):
        assert torch.equal(s.out, p.out)  # the same bf16 weights
        assert torch.equal(s.m, p.m) and torch.equal(s.v, p.v)
        joined = host_adamw.join_master(s.out, s.x)
        ties = (joined != p.x).sum().item()  # a tie rounded down moves one ulp
        assert ties <= max(3, p.x.numel() >> 12), ties


def test_portable_loops_match_the_formula_bitwise() -> None:
    """The kernel built without its AVX-512 loops (what a CPU without AVX-512 runs): every
    dtype combination, fp32 and split master, over the threads' chunks and the tails."""
    _native_kernel()
    if platform.machine().lower() not in ("x86_64", "amd64"):  # the flag is x86's
        pytest.skip(f"-mno-avx512f is an x86 flag; this machine is {platform.machine()}")
    kernel = host_adamw.load(("-mno-avx512f",))  # on x86 a failed build fails the test
    host_adamw.self_check(kernel, host_adamw.ALL_COMBOS, n=70_001)
    host_adamw.self_check(kernel, host_adamw.SPLIT_COMBOS, n=70_001, split=True)
    start = torch.tensor([1.0] * 40 + [1.0078125] * 30)  # both rounding ties, as below
    coef = (1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 2.0**-8, 1.0)
    n = start.numel()
    seg = Seg(torch.zeros(n, dtype=torch.int16), torch.ones(n), torch.zeros(n), torch.zeros(n),
              start.to(torch.bfloat16), coef)  # fmt: skip
    kernel([seg])
    assert seg.x[:40].eq(0x7FFF).all() and seg.x[40:].eq(-0x8000).all()


def test_split_master_holds_every_value_it_can() -> None:
    """Exact joins for finite values, infinities and values that round to infinity; a NaN
    stays a NaN; the one tie int16 cannot hold moves one ulp towards its bf16 weight."""
    kernel = _native_kernel()
    bits = torch.tensor(
        [0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000,
         0xFF800000, 0x00000001, 0x80000000, 0x7FC00001, 0xFFFFFFFF, 0x3F800000, 0x00808000],
        dtype=torch.int64,
    ).to(torch.int32)  # fmt: skip
    x = bits.repeat(5).view(torch.float32)  # 70 values: the 16-lane loop and the tail
    hi = torch.empty(x.numel(), dtype=torch.bfloat16)
    lo = host_adamw.split_master(x, hi)
    assert torch.equal(hi.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    joined = host_adamw.join_master(hi, lo)
    nan = x.isnan()
    assert joined[nan].isnan().all()
    tie_down = torch.tensor([1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1], dtype=torch.bool).repeat(5)
    keep = ~nan & ~tie_down
    assert torch.equal(joined[keep].view(torch.int32), x[keep].view(torch.int32))
    assert torch.equal(joined[tie_down].view(torch.int32), x[tie_down].view(torch.int32) - 1)
    # a step whose result is a tie: x + 2^-8 from x = 1 (rounds down: the nudge) and from
    # x = 1 + 2^-7 (rounds up: remainder -0x8000), through the 16-lane loop and the tail
    kernel = _native_kernel()
    start = torch.tensor([1.0] * 40 + [1.0078125] * 30)
    coef = (1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 2.0**-8, 1.0)  # x + 2^-8 * g / |g|, g = 1
    n = start.numel()

    def tie_step():
        hi = start.to(torch.bfloat16)
        return Seg(torch.zeros(n, dtype=torch.int16), torch.ones(n), torch.zeros(n),
                   torch.zeros(n), hi, coef)  # fmt: skip

    want, got = tie_step(), tie_step()
    host_adamw.eager_kernel([want])
    kernel([got])
    _assert_same([want], [got])
    assert got.x[:40].eq(0x7FFF).all() and got.x[40:].eq(-0x8000).all()
    assert got.out[:40].eq(1.0).all() and got.out[40:].eq(1.015625).all()


def test_split_master_is_used_where_it_can_be() -> None:
    """One process with every weight bf16 and the native kernel: 2-byte remainders instead
    of 4-byte master weights. Mixed dtypes or the compiled step keep the fp32 master."""
    _native_kernel()
    model = TinyMoE().to(torch.bfloat16)
    master = OffloadAdamW(model.named_parameters(), fused_step="auto").host_buffers()["master"]
    assert master.dtype == torch.int16
    compiled = OffloadAdamW(model.named_parameters(), fused_step="compile")
    assert compiled.host_buffers()["master"].dtype == torch.float32
    mixed = TinyMoE().to(torch.bfloat16)
    mixed.moe.w1.data = mixed.moe.w1.data.float()
    assert OffloadAdamW(mixed.named_parameters()).host_buffers()["master"].dtype == torch.float32


def _trained_split(steps: int) -> tuple[TinyMoE, OffloadAdamW]:
    """A bf16 TinyMoE and its split-master OffloadAdamW after ``steps`` steps."""
    _native_kernel()
    model = TinyMoE().to(torch.bfloat16)
    opt = OffloadAdamW(model.named_parameters(), lr=LR, fused_step="native")
    for step in range(steps):
        micro_step(model, step)
        opt.step()
        opt.zero_grad()
    return model, opt


def test_split_and_plain_master_checkpoints_load_into_each_other() -> None:
    """A checkpoint holds the fp32 master either way: a split run resumes on the reference
    path and back, with the same master, moments and weights."""
    _native_kernel()
    model, opt = _trained_split(3)
    saved = opt.state_dict()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = OffloadAdamW(model.named_parameters(), lr=LR, fused_step="off")
    plain.load_state_dict(saved)
    again = OffloadAdamW(model.named_parameters(), lr=LR, fused_step="native")
    again.load_state_dict(plain.state_dict())
    for other in (plain, again):
        for key, entry in other.state_dict()["state"].items():
            for name, t in entry.items():
                want = saved["state"][key][name]
                assert torch.equal(torch.as_tensor(t), torch.as_tensor(want)), (key, name)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), weights[n]), n


def test_split_master_takes_writes_to_the_weights() -> None:
    """Direct split mode: the parameters are the master's bf16 half, so writes to them between
    steps become the master (exactly when made on the parameter, as nn.init and
    load_state_dict do); a write of zeros through .data never joins a stale remainder into a
    NaN. Against torch AdamW on fp32 copies that get the same writes."""
    _native_kernel()
    gen = torch.Generator().manual_seed(6)
    w = torch.nn.Parameter(torch.randn(4096, generator=gen).bfloat16())
    ref = torch.nn.Parameter(w.detach().float())
    opt = OffloadAdamW([("w", w)], lr=1e-3, weight_decay=0.0, fused_step="native")
    ref_opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.0)
    assert opt.host_buffers()["master"].dtype == torch.int16

    def step() -> None:
        g = torch.randn(4096, generator=gen)
        w.grad, ref.grad = g.bfloat16(), g.bfloat16().float()
        opt.step()
        ref_opt.step()

    for _ in range(3):
        step()
    with torch.no_grad():  # a write on the parameter: versioned
        torch.nn.init.normal_(w, std=0.5, generator=gen)
        ref.copy_(w.float())
    step()
    master = next(iter(opt.state_dict()["state"].values()))["master"]
    assert_rel_close(master, ref.detach(), "after nn.init", 1e-6)
    w.data.zero_()  # through .data: not versioned, the remainders are stale
    with torch.no_grad():
        ref.zero_()
    step()
    master = next(iter(opt.state_dict()["state"].values()))["master"]
    assert not master.isnan().any() and not w.isnan().any()
    assert_rel_close(master, ref.detach(), "after .data.zero_()", 1e-6)
    lo = opt.host_buffers()["master"]
    lo.copy_(torch.randint(-0x8000, 0x8000, lo.shape, generator=gen, dtype=torch.int16))
    w.data.fill_(float("inf"))  # stale remainders of both signs under infinite weights
    joined = host_adamw.join_master(w.detach(), lo)  # a negative remainder: a finite value that
    assert not joined.isnan().any() and torch.isinf(joined[lo >= 0]).all()  # rounds to inf
    w.grad = torch.zeros_like(w)
    opt.step()
    assert not w.isnan().any()  # a positive remainder counts as 0 in the kernel too


def test_prepared_slices_are_kept_per_param_group(monkeypatch) -> None:
    """Two param groups (decay and no decay, as the trainer builds them): the pointer arrays
    of each are built once while the gradients stay where they are, and rebuilt when a new
    .grad tensor lands elsewhere."""
    kernel = _native_kernel()
    model = TinyMoE().to(torch.bfloat16)
    opt = OffloadAdamW(groups(model), lr=LR, fused_step="native")
    assert len(opt.param_groups) == 2
    calls = []
    prepare = type(kernel).prepare
    monkeypatch.setattr(
        type(kernel), "prepare", staticmethod(lambda segs: calls.append(1) or prepare(segs))
    )
    grads = None
    for step in range(4):
        micro_step(model, step)
        if grads is None:
            grads = {n: p.grad for n, p in model.named_parameters()}
        else:  # the same tensors: copy this step's gradients into them
            for n, p in model.named_parameters():
                grads[n].copy_(p.grad)
                p.grad = grads[n]
        opt.step()
        opt.zero_grad(set_to_none=False)
    assert len(calls) == 2  # one per group


def test_split_master_resumes_in_either_load_order() -> None:
    """Optimizer state loaded before the model (whose load writes the same bf16 weights back)
    or after it: the loaded master is kept either way; a save sees writes made since."""
    torch.manual_seed(7)
    model, opt = _trained_split(2)
    saved_opt, saved_model = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    for optimizer_first in (True, False):
        fresh = TinyMoE().to(torch.bfloat16)
        again = OffloadAdamW(fresh.named_parameters(), lr=LR, fused_step="native")
        if optimizer_first:
            again.load_state_dict(saved_opt)
            fresh.load_state_dict(saved_model)
        else:
            fresh.load_state_dict(saved_model)
            again.load_state_dict(saved_opt)
        for key, entry in again.state_dict()["state"].items():
            assert torch.equal(entry["master"], saved_opt["state"][key]["master"]), key
    with torch.no_grad():
        model.moe.w2.zero_()  # a write, then a save before any step: the save holds it
    (master,) = [e["master"] for k, e in opt.state_dict()["state"].items() if "w2" in k][:1]
    assert master.abs().max() == 0
