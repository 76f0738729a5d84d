"""The persistent grouped GEMM wired into the layer: its config fields and table entries,
the classic kernel as the default, and the layer (``moe_experts``) and ``grouped_gemm``
forward and backward against float64 with persistent configs forced, one tile table built
per call, in the interpreter (fp32). test_persistent.py checks the kernel itself, also in
bf16 on a GPU."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.kernels import interpreter_only, layer_inputs, rel_err

pytest.importorskip("triton")

from moestack.kernels import _launch, _tiles, grouped_gemm, moe_experts, tuned_table, tuning  # noqa: E402
from moestack.kernels.reference import (  # noqa: E402
    grouped_gemm_reference,
    moe_experts_reference,
)

interpreted = interpreter_only(
    "the interpreter's run; test_persistent.py checks the kernel on CUDA"
)
TOL = 5e-6  # float32, normwise: max|err| / max|ref|
# Small tiles and 3 programs: each program walks several tiles, tiles cross expert borders.
SMALL = tuning.KernelConfig(16, 32, 16, 2, 4, 1, persistent=True, num_programs=3)
CONFIGS = {"small-3-programs": SMALL, "default-candidate": tuning.PERSISTENT_CANDIDATES[0]}


@pytest.fixture
def spies(monkeypatch):
    """What the launches did: the persistent launches' configs, the tile tables built (their
    block_m) and the tensor descriptors made (their shapes); everything still runs."""
    from moestack.kernels import _persistent

    seen: dict[str, list] = {"launches": [], "tables": [], "descriptors": []}
    real_mm, real_table = _launch.persistent_mm, _tiles.tile_table
    real_desc = _persistent._host_descriptor

    def mm(*args, **kw):
        seen["launches"].append(kw["cfg"])
        return real_mm(*args, **kw)

    def table(offsets_E, rows, block_m):
        seen["tables"].append(block_m)
        return real_table(offsets_E, rows, block_m)

    def desc(t, shape, strides, block):
        seen["descriptors"].append(list(shape))
        return real_desc(t, shape, strides, block)

    monkeypatch.setattr(_launch, "persistent_mm", mm)
    monkeypatch.setattr(_tiles, "tile_table", table)
    monkeypatch.setattr(_persistent, "_host_descriptor", desc)
    return seen


LAYER_CASES = {
    # odd D and F: no operand has 16-byte rows, every load goes through pointers
    "ragged-empty-odd": dict(T=40, D=37, F=21, E=5, k=2, empty=3),
    # 16-byte rows: descriptors read h, dy's rows, dz and the weights
    "ragged-empty-aligned": dict(T=40, D=32, F=24, E=5, k=2, empty=1),
    "one-token": dict(T=1, D=33, F=17, E=4, k=2),
    "top_k-equals-E": dict(T=9, D=20, F=16, E=3, k=3),
}


@interpreted
@pytest.mark.parametrize("cfg", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize("case", list(LAYER_CASES.values()), ids=list(LAYER_CASES))
def test_layer_with_persistent_gemms_matches_float64(case, cfg, poisoned_buffers, spies):
    """Output and the four gradients, h @ W2, G and dx by the persistent kernel: one tile
    table for the forward, one shared by the backward's two GEMMs."""
    x, w1, w2, experts, weights, dy = layer_inputs(**case, seed=case["T"])
    ins = [t.float().requires_grad_() for t in (x, w1, w2, weights)]
    with tuning.forced_config("mm", cfg):
        y = moe_experts(ins[0], ins[1], ins[2], experts, ins[3])
        assert len(spies["launches"]) == 1 and spies["tables"] == [cfg.block_m]
        y.backward(dy.float())
    assert len(spies["launches"]) == 3, "h @ W2, G and dx"
    assert spies["tables"] == [cfg.block_m] * 2, "one table per call, shared by G and dx"
    refs = [t.clone().requires_grad_() for t in (x, w1, w2, weights)]
    yr = moe_experts_reference(refs[0], refs[1], refs[2], experts, refs[3])
    yr.backward(dy)
    got = [y.detach()] + [t.grad for t in ins]
    want = [yr.detach()] + [t.grad for t in refs]
    for name, a, b in zip(("y", "dx", "dw1", "dw2", "dweights"), got, want, strict=True):
        assert rel_err(a, b) <= TOL, name
    if "empty" in case:  # an expert without tokens: exact zeros
        assert not ins[1].grad[case["empty"]].any() and not ins[2].grad[case["empty"]].any()
    from moestack.kernels import _persistent

    if _persistent.descriptors_available():  # chosen by the tensors' layout, never by failure
        assert bool(spies["descriptors"]) == (case["D"] % 4 == 0 and case["F"] % 4 == 0)


@interpreted
@pytest.mark.parametrize("cfg", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize(
    ("counts", "K", "M"),
    [([0, 33, 1, 0, 60], 40, 24), ([1], 8, 12), ([0, 0, 50], 45, 30)],
    ids=["ragged-empty", "one-row", "one-expert-odd"],
)
def test_grouped_gemm_with_persistent_gemms_matches_float64(
    counts, K, M, cfg, poisoned_buffers, spies
):
    """y and dx of the plain grouped GEMM by the persistent kernel (dW by its own kernel)."""
    g = torch.Generator().manual_seed(sum(counts))
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), K, generator=g, dtype=torch.float64)
    w = torch.randn(len(counts), K, M, generator=g, dtype=torch.float64)
    dy = torch.randn(sum(counts), M, generator=g, dtype=torch.float64)
    x32, w32 = x.float().requires_grad_(), w.float().requires_grad_()
    with tuning.forced_config("mm", cfg):
        y = grouped_gemm(x32, w32, offsets)
        y.backward(dy.float())
    assert len(spies["launches"]) == 2 and spies["tables"] == [cfg.block_m] * 2
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr = grouped_gemm_reference(xr, wr, offsets)
    yr.backward(dy)
    for name, a, b in (("y", y.detach(), yr.detach()), ("dx", x32.grad, xr.grad)):
        assert rel_err(a, b) <= TOL, name
    assert rel_err(w32.grad, wr.grad) <= TOL, "dw"


@interpreted
def test_classic_kernel_by_default_builds_no_table(spies):
    """Nothing forced and nothing tuned: the classic kernel, and no tile table is built."""
    x, w1, w2, experts, weights, dy = layer_inputs(T=12, D=16, F=8, E=3, k=2, seed=1)
    ins = [t.float().requires_grad_() for t in (x, w1, w2, weights)]
    moe_experts(ins[0], ins[1], ins[2], experts, ins[3]).backward(dy.float())
    assert spies == {"launches": [], "tables": [], "descriptors": []}


def test_tiles_of_other_rows_are_refused():
    pytest.importorskip("triton")
    offsets = torch.tensor([3, 8], dtype=torch.int32)
    a, w, out = torch.randn(8, 16), torch.randn(2, 16, 16), torch.empty(8, 16)
    for tiles in (_tiles.TileTables(offsets, 7), _tiles.TileTables(offsets.clone(), 8)):
        with pytest.raises(ValueError, match="tiles were built for other rows"):
            _launch.grouped_mm(a, w, offsets, out, 8, tiles=tiles)


def test_tile_tables_build_once_per_block_m(spies):
    offsets = torch.tensor([0, 5, 5, 40], dtype=torch.int32)
    tables = _tiles.TileTables(offsets, 40)
    first = tables.get(16)
    assert tables.get(16) is first and tables.get(32) is not first
    assert spies["tables"] == [16, 32] and tables.built() == [16, 32]
    assert first.count.tolist() == [1 + 0 + 3]  # 5 rows, then 35 rows in 16-row tiles


# ---- configs, candidates and the table ----------------------------------------------------


def test_persistent_candidates_follow_the_classic_default():
    """The plain GEMM's candidates: the classic tiles first (the first is the default when
    nothing was measured), then the persistent ones; no other kind has any."""
    for dtype in (torch.bfloat16, torch.float32):
        cands = tuning.candidates("mm", 4096, 4096, dtype)
        n = len(tuning.PERSISTENT_CANDIDATES)
        assert not any(c.persistent for c in cands[:-n]) and all(c.persistent for c in cands[-n:])
        assert cands[-n:] == [tuning.fit(c, "mm", 4096, 4096, dtype) for c in
                              tuning.PERSISTENT_CANDIDATES]  # fmt: skip
        assert cands[0] == tuning.fit(tuning.CANDIDATES["mm"][0], "mm", 4096, 4096, dtype)
        for kind in ("mm_swiglu", "wgrad"):
            assert not any(c.persistent for c in tuning.candidates(kind, 64, 64, dtype))
    assert all(c.num_programs == 0 for c in tuning.PERSISTENT_CANDIDATES)  # one per SM


def test_default_without_a_table_is_the_classic_kernel(monkeypatch, tmp_path):
    def never(cfg):
        raise AssertionError("autotuning is off: nothing is timed")

    monkeypatch.setenv("MOESTACK_AUTOTUNE", "0")
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", str(tmp_path / "none.json"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fancy GPU")
    tuning.clear_cache()
    try:
        got = tuning.choose_config(
            "mm", "mm|new", torch.device("cpu"), 256, 256, torch.bfloat16, never, False
        )
    finally:
        tuning.clear_cache()
    assert not got.persistent and got == tuning.candidates("mm", 256, 256, torch.bfloat16)[0]


def test_autotuning_may_choose_the_persistent_kernel(monkeypatch):
    """A persistent candidate is one more timed candidate: the faster one wins, either way."""
    cands = tuning.candidates("mm", 256, 256, torch.bfloat16)
    launched = []

    def run(cfg):
        launched.append(cfg)

    for fast in (cands[-1], cands[0]):
        monkeypatch.setattr(
            tuning, "_time_ms", lambda fn, fast=fast: (fn(), 0.5 if launched[-1] == fast else 1)[1]
        )
        assert tuning._benchmark("mm|key", cands, run) == fast


def write_table(path, entries, monkeypatch):
    path.write_text(
        json.dumps({"format": tuned_table.TABLE_FORMAT, "gpus": {"Fancy GPU": entries}})
    )
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", str(path))
    tuning.clear_cache()


def test_table_entries_read_and_written(tmp_path, monkeypatch):
    """A persistent entry says so; an entry without the fields (every table written before
    the persistent kernel) is the classic kernel, and classic entries are written without
    them, as before."""
    key_p, key_c = "mm|E=8|K=64|M=64|bfloat16|g0s0c0z0t1|R=1024", "mm|x|R=1024"
    persistent = tuning.KernelConfig(128, 256, 64, 8, 8, 3, persistent=True, num_programs=66)
    classic = {"block_m": 64, "block_n": 64, "block_k": 64, "backend": "triton"}
    write_table(
        tmp_path / "t.json",
        {key_p: tuned_table.table_entry(persistent), key_c: classic},
        monkeypatch,
    )
    try:
        assert tuned_table.lookup_table("Fancy GPU", key_p) == persistent
        old = tuned_table.lookup_table("Fancy GPU", key_c)
        assert not old.persistent and old.num_programs == 0
        tuning.cache_config("Fancy GPU", key_p, persistent)
        tuning.cache_config("Fancy GPU", key_c, old)
        exported = tuning.export_cache()["Fancy GPU"]
    finally:
        tuning.clear_cache()
    assert exported[key_p]["persistent"] is True and exported[key_p]["num_programs"] == 66
    assert "persistent" not in exported[key_c] and "num_programs" not in exported[key_c]
    assert tuned_table.parse_entry(exported[key_p], key_p, None).config == persistent


def test_a_persistent_entry_of_another_kind_gives_the_default(tmp_path, monkeypatch):
    """Only kind "mm" runs the persistent kernel: an (edited) entry naming it for the SwiGLU
    GEMM gives that kind's default tile, chosen before any launch."""
    key = "mm_swiglu|E=8|K=64|M=64|bfloat16|g1s0c0z1t0|R=1024"
    entry = tuned_table.table_entry(tuning.PERSISTENT_CANDIDATES[0])
    write_table(tmp_path / "t.json", {key: entry}, monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fancy GPU")
    try:
        got = tuning.choose_config(
            "mm_swiglu", key, torch.device("cpu"), 64, 64, torch.bfloat16, None, False
        )
    finally:
        tuning.clear_cache()
    assert got == tuning.fit(tuning.CANDIDATES["mm_swiglu"][0], "mm_swiglu", 64, 64, torch.bfloat16)


def test_bad_persistent_configs_are_refused():
    cfg = tuning.PERSISTENT_CANDIDATES[0]
    for kind in ("mm_swiglu", "wgrad"):
        with (
            pytest.raises(ValueError, match=f"persistent=True is for kind='mm' only, not '{kind}'"),
            tuning.forced_config(kind, cfg),
        ):
            pass
    with pytest.raises(ValueError, match="use backend='triton'"):
        tuning.KernelConfig(128, 128, 64, persistent=True, backend="torch")
    with pytest.raises(ValueError, match="num_programs=4 needs persistent=True"):
        tuning.KernelConfig(128, 128, 64, num_programs=4)
    with pytest.raises(ValueError, match="num_programs=-1"):
        tuning.KernelConfig(128, 128, 64, persistent=True, num_programs=-1)


@interpreted
def test_a_timed_persistent_candidate_builds_its_own_table(monkeypatch, spies):
    """While autotuning, each timed launch of a persistent candidate builds its tile table
    (the tuner charges it the table); the launch afterwards takes the call's shared one."""
    fresh = []
    real = _launch.tile_table
    monkeypatch.setattr(_launch, "tile_table", lambda *a: (fresh.append(a[2]), real(*a))[1])

    def choose(kind, key, device, K, M, dtype, run, interpret):
        for _ in range(2):  # two timed launches, as the tuner's repeats
            run(SMALL)
        return SMALL

    monkeypatch.setattr(tuning, "choose_config", choose)
    offsets = torch.tensor([0, 20, 21, 40], dtype=torch.int32)
    a, w = torch.randn(40, 16, dtype=torch.float64), torch.randn(4, 16, 24, dtype=torch.float64)
    out = torch.full((40, 24), float("nan"))
    tiles = _tiles.TileTables(offsets, 40)
    _launch.grouped_mm(a.float(), w.float(), offsets, out, 40, tiles=tiles)
    assert fresh == [SMALL.block_m] * 2 and tiles.built() == [SMALL.block_m]
    assert len(spies["launches"]) == 3
    want = torch.cat(
        [a[s:e] @ w[i] for i, (s, e) in enumerate([(0, 0), (0, 20), (20, 21), (21, 40)])]
    )
    assert rel_err(out, want) <= TOL
