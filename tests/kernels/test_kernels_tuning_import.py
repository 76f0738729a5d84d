"""Config selection, the tuned table, and imports without triton or megablocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moestack.kernels import tuned_table, tuning


def test_shipped_table_parses_and_invents_nothing():
    """Every shipped entry is a valid config that says where it came from in so many words
    (not by the default of an older table); a measured one names the GPU it is filed under."""
    data = json.loads(tuned_table.TABLE_PATH.read_text())
    assert data["format"] == tuned_table.TABLE_FORMAT
    parsed = tuned_table.parse_table(data, "shipped")
    for gpu, entries in data["gpus"].items():
        for key, raw in entries.items():
            assert key.split("|")[0] in tuning.CANDIDATES, (gpu, key)
            assert raw["source"] in tuning.ENTRY_SOURCES, (gpu, key)
            entry = parsed[gpu][key]
            assert entry.source == raw["source"] and entry.key == key
            if entry.source == "measured":
                assert entry.provenance["gpu"] == gpu, (gpu, key)


def write_table(path, entries, monkeypatch, fmt=tuned_table.TABLE_FORMAT):
    path.write_text(json.dumps({"format": fmt, "gpus": {"Fancy GPU": entries}}))
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", str(path))
    tuning.clear_cache()


def test_table_lookup(tmp_path, monkeypatch):
    key = tuning.make_key("mm", 8, 4096, 14336, torch.bfloat16, "g1s0c0z1t0", 16384)
    assert key == "mm|E=8|K=4096|M=14336|bfloat16|g1s0c0z1t0|R=16384"
    assert tuning.make_key("mm", 8, 4096, 14336, torch.bfloat16, "g1s0c0z1t0", 9000) == key
    cfg = tuning.KernelConfig(64, 128, 32, 4, 4, 5)
    write_table(tmp_path / "table.json", {key: cfg.__dict__}, monkeypatch)
    assert tuned_table.lookup_table("Fancy GPU", key) == cfg
    assert tuned_table.lookup_table("Other GPU", key) is None
    assert tuned_table.lookup_table("Fancy GPU", key.replace("E=8", "E=16")) is None
    assert tuned_table.lookup_table("Fancy GPU", key.replace("t0", "t1")) is None  # W^T: other key


def test_table_lookup_takes_the_nearest_row_bucket(tmp_path, monkeypatch):
    def key(rows):
        return tuning.make_key("wgrad", 64, 2048, 2048, torch.bfloat16, "g10", rows)

    small, big = tuning.KernelConfig(64, 64, 64), tuning.KernelConfig(128, 128, 64)
    entries = {key(2048): small.__dict__, key(65536): big.__dict__}
    write_table(tmp_path / "table.json", entries, monkeypatch)
    assert tuned_table.lookup_table("Fancy GPU", key(2048)) == small  # exact
    assert tuned_table.lookup_table("Fancy GPU", key(4096)) == small  # one power of two away
    assert tuned_table.lookup_table("Fancy GPU", key(32768)) == big
    assert tuned_table.lookup_table("Fancy GPU", key(8192)) == small  # a tie: the smaller bucket
    assert tuned_table.lookup_table("Fancy GPU", key(16)) == small
    other = tuning.make_key("wgrad", 64, 2048, 2048, torch.bfloat16, "g01", 2048)
    assert tuned_table.lookup_table("Fancy GPU", other) is None  # another variant never matches


def test_tables_of_the_old_key_format_are_ignored(tmp_path, monkeypatch, caplog):
    key = "mm|E=8|K=4096|M=14336|bfloat16|g1s0c0z1"  # format 1: no layout flag, no rows
    write_table(
        tmp_path / "old.json",
        {key: {"block_m": 64, "block_n": 64, "block_k": 32}},
        monkeypatch,
        fmt=1,
    )
    assert tuned_table.lookup_table("Fancy GPU", key) is None
    assert "unknown format 1" in caplog.text and str(tmp_path / "old.json") in caplog.text
    assert len(caplog.records) == 1 and "\n" not in caplog.records[0].getMessage()
    tuning.clear_cache()


def test_format_2_tables_are_read_as_moestack_kernels(tmp_path, monkeypatch):
    """Format 2 entries have no backend field: moestack's kernel, as they were tuned."""
    key = tuning.make_key("wgrad", 8, 4096, 28672, torch.bfloat16, "g00", 16384)
    write_table(tmp_path / "v2.json", {key: {"block_m": 64, "block_n": 64, "block_k": 32}},
                monkeypatch, fmt=2)  # fmt: skip
    assert tuned_table.lookup_table("Fancy GPU", key) == tuning.KernelConfig(64, 64, 32)
    assert tuned_table.lookup_table("Fancy GPU", key).backend == "triton"
    tuning.clear_cache()


SEED_ENTRY = {"block_m": 64, "block_n": 64, "block_k": 32, "source": "seed"}
SEED_CFG = tuning.KernelConfig(64, 64, 32)
H200 = {"gpu": "Fancy GPU", "date": "2026-11-30", "torch": "2.11.0", "triton": "3.6.0"}
MEASURED_ENTRY = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8,
                  "source": "measured", "provenance": H200}  # fmt: skip


def wkey(rows: int, flags: str = "g00") -> str:
    return tuning.make_key("wgrad", 8, 4096, 28672, torch.bfloat16, flags, rows)


def test_lookups_report_each_entrys_source(tmp_path, monkeypatch):
    """A seeded and a measured entry: each lookup hands back the config with its source and
    the measured one's provenance; a lookup that takes a neighbouring row bucket's entry says
    which key it is."""
    write_table(tmp_path / "v4.json", {wkey(16384): SEED_ENTRY, wkey(16384, "g10"): MEASURED_ENTRY},
                monkeypatch)  # fmt: skip
    seed = tuning.lookup_entry("Fancy GPU", wkey(16384))
    assert (seed.config, seed.source, seed.provenance) == (SEED_CFG, "seed", None)
    measured = tuning.lookup_entry("Fancy GPU", wkey(16384, "g10"))
    assert measured.config == tuning.KernelConfig(128, 128, 64, num_warps=8)
    assert (measured.source, measured.provenance) == ("measured", H200)
    near = tuning.lookup_entry("Fancy GPU", wkey(32768, "g10"))  # its neighbour's entry
    assert near.source == "measured" and near.key == wkey(16384, "g10")
    assert tuned_table.lookup_table("Fancy GPU", wkey(16384)) == seed.config
    tuning.clear_cache()


def test_tables_without_sources_read_their_entries_as_seeds(tmp_path, monkeypatch):
    """A format 3 table (no source field) is read, not refused: its entries are seeds,
    except those its ``sources`` record says were measured (the GPU added to the record)."""
    stamp = {"date": "2026-01-02", "torch": "2.9.0", "triton": "3.5.0"}
    old = {"block_m": 64, "block_n": 64, "block_k": 32}
    payload = {"format": 3, "gpus": {"Fancy GPU": {wkey(16384): old, wkey(16384, "g10"): old}},
               "sources": {"Fancy GPU": {wkey(16384, "g10"): stamp}}}  # fmt: skip
    (tmp_path / "v3.json").write_text(json.dumps(payload))
    monkeypatch.setenv("MOESTACK_TUNED_CONFIGS", str(tmp_path / "v3.json"))
    tuning.clear_cache()
    seed = tuning.lookup_entry("Fancy GPU", wkey(16384))
    assert (seed.config, seed.source, seed.provenance) == (SEED_CFG, "seed", None)
    measured = tuning.lookup_entry("Fancy GPU", wkey(16384, "g10"))
    assert (measured.source, measured.provenance) == ("measured", {"gpu": "Fancy GPU", **stamp})
    tuning.clear_cache()


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({**SEED_ENTRY, "source": "guessed"}, r"source='guessed' is unknown"),
        ({**SEED_ENTRY, "source": "measured"}, r"needs its provenance's \['gpu', 'date'"),
        ({**SEED_ENTRY, "provenance": H200}, r"a seed has no provenance"),
    ],
)
def test_an_entry_with_a_bad_source_names_itself(tmp_path, monkeypatch, entry, match):
    write_table(tmp_path / "bad.json", {wkey(16384): entry}, monkeypatch)
    with pytest.raises(ValueError, match=match) as err:
        tuning.lookup_entry("Fancy GPU", wkey(16384))
    assert wkey(16384) in str(err.value) and str(tmp_path / "bad.json") in str(err.value)
    tuning.clear_cache()


def test_table_entries_name_their_backend(tmp_path, monkeypatch):
    key = tuning.make_key("wgrad", 8, 4096, 28672, torch.bfloat16, "g00", 16384)
    entry = {"block_m": 128, "block_n": 128, "block_k": 64, "backend": "torch"}
    write_table(tmp_path / "v3.json", {key: entry}, monkeypatch)
    assert tuned_table.lookup_table("Fancy GPU", key) == tuning.TORCH_WGRAD
    tuning.cache_config("Fancy GPU", key, tuning.TORCH_WGRAD)
    tuning.cache_config("Fancy GPU", "mm|k", tuning.CANDIDATES["mm"][0])
    exported = tuning.export_cache()["Fancy GPU"]
    assert exported[key]["backend"] == "torch" and exported["mm|k"]["backend"] == "triton"
    tuning.clear_cache()


def test_autotuning_may_choose_torchs_weight_gradient(monkeypatch):
    """torch's backend is one more timed candidate: the faster one wins, either way."""
    pytest.importorskip("triton")
    cands = tuning.candidates("wgrad", 64, 64, torch.bfloat16, torch.device("cpu"))
    assert cands[-1] == tuning.TORCH_WGRAD and cands[0].backend == "triton"
    for fast in (cands[-1], cands[1]):
        time_ms, run = _fake_timer({}, {fast: 0.5})
        monkeypatch.setattr(tuning, "_time_ms", time_ms)
        assert tuning._benchmark("wgrad|key", cands, run) == fast


def test_candidates_clip_to_small_problems():
    for kind in tuning.CANDIDATES:
        for dtype in (torch.bfloat16, torch.float32):
            cands = tuning.candidates(kind, K=20, M=5, dtype=dtype)
            assert cands and len(set(cands)) == len(cands)
            for c in cands:
                assert min(c.block_m, c.block_n, c.block_k) >= 16
                if kind == "wgrad":
                    assert c.block_m <= 32 and c.block_n == 16
                else:
                    assert c.block_n == 16 and c.block_k <= 32


def test_weight_gradient_candidates_include_five_stages():
    """A gathered weight gradient loses a stage to its index loads: five stages keep three
    tile buffers in flight (the compile test below measures it)."""
    five = [c for c in tuning.CANDIDATES["wgrad"] if c.num_stages == 5]
    assert five and tuning.CANDIDATES["wgrad"][0].num_stages == 3  # the default is unchanged
    assert all(c in tuning.candidates("wgrad", 4096, 4096, torch.bfloat16) for c in five)


def test_forced_config_wins_over_everything_and_is_fitted(monkeypatch):
    def fail(cfg):
        raise AssertionError("a forced config is never timed")

    big = tuning.CANDIDATES["mm"][2]  # 128 x 256 x 64
    with tuning.forced_config("mm", big):
        for interpret in (True, False):  # ahead of the interpreter's config and the GPU path
            got = tuning.choose_config(
                "mm", "k", torch.device("cpu"), 20, 5, torch.float32, fail, interpret
            )
            assert got == tuning.fit(big, "mm", 20, 5, torch.float32)
            assert got.block_n == 16 and got.block_k == 16 and got.block_m == 128
        other = tuning.choose_config(
            "wgrad", "k", torch.device("cpu"), 8, 8, torch.float32, fail, True
        )
        assert other == tuning.INTERPRET_CONFIG  # only the forced kind
    assert "mm" not in tuning._FORCED
    with (
        pytest.raises(ValueError, match="kind='nope' is unknown"),
        tuning.forced_config("nope", big),
    ):
        pass


def _resource_error():
    from triton.runtime.errors import OutOfResources

    return OutOfResources(300_000, 232_448, "shared memory")


def _compile_error():
    import ast

    from triton.compiler.errors import CompilationError

    return CompilationError("src", ast.Pass(), "tile too large")


def _fake_timer(errors, times=None):
    """A stand-in for do_bench on the CPU and a launch: the launch of a config in ``errors``
    raises its error; timing runs the launch once and returns ``times[cfg]`` (default 1)."""
    times = times or {}
    launched = []

    def run(cfg):
        launched.append(cfg)
        if cfg in errors:
            raise errors[cfg]

    def time_ms(fn):
        fn()
        return times.get(launched[-1], 1.0)

    return time_ms, run


def test_tuner_skips_configs_that_do_not_fit(monkeypatch, caplog):
    pytest.importorskip("triton")
    cands = list(tuning.CANDIDATES["mm"][:4])
    errors = {cands[0]: _resource_error(), cands[1]: _compile_error()}
    time_ms, run = _fake_timer(errors, {cands[2]: 2.0, cands[3]: 1.0})
    monkeypatch.setattr(tuning, "_time_ms", time_ms)
    caplog.set_level("INFO", logger=tuning.__name__)
    assert tuning._benchmark("mm|key", cands, run) == cands[3]
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert caplog.text.count("skipped") == 2 and "out of resource" in caplog.text
    with pytest.raises(RuntimeError, match=r"no tile config of mm\|key fits this GPU \(all 2"):
        tuning._benchmark("mm|key", cands[:2], run)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        ValueError("a bug in the launcher"),
    ],
)
def test_tuner_raises_any_other_error_with_a_warning(monkeypatch, caplog, error):
    """An illegal address leaves the CUDA context unusable: trying the next candidate would
    only bury the cause under "no config could run"."""
    pytest.importorskip("triton")
    cands = list(tuning.CANDIDATES["wgrad"][:3])
    time_ms, run = _fake_timer({cands[1]: error})
    monkeypatch.setattr(tuning, "_time_ms", time_ms)
    with pytest.raises(type(error), match=str(error)):
        tuning._benchmark("wgrad|key", cands, run)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(cands[1]) in warnings[0].getMessage()
    assert "wgrad|key" in warnings[0].getMessage()


def test_launch_without_registers_is_skipped(monkeypatch):
    pytest.importorskip("triton")
    cands = list(tuning.CANDIDATES["mm"][:2])
    error = RuntimeError("Triton Error [CUDA]: too many resources requested for launch")
    time_ms, run = _fake_timer({cands[0]: error})
    monkeypatch.setattr(tuning, "_time_ms", time_ms)
    assert tuning._benchmark("mm|key", cands, run) == cands[1]


def test_interpreter_uses_fixed_config():
    def fail(cfg):
        raise AssertionError("no timing under the interpreter")

    cfg = tuning.choose_config("mm", "k", torch.device("cpu"), 8, 8, torch.float32, fail, True)
    assert cfg == tuning.INTERPRET_CONFIG


def test_autotune_switch(monkeypatch):
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "0")
    assert not tuning.autotune_enabled()
    monkeypatch.setenv("MOESTACK_AUTOTUNE", "1")
    assert tuning.autotune_enabled()


# How long a child Python may take: compiling every candidate tile for sm90 from a cold
# Triton cache takes about 30 s on an idle 2-core machine; several times that under load.
CHILD_DEADLINE_S = 900


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env,
            timeout=CHILD_DEADLINE_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as err:
        raise AssertionError(
            f"the child Python (compiling Triton kernels, or importing without triton) did not "
            f"finish in {CHILD_DEADLINE_S} s (CHILD_DEADLINE_S); its output so far: "
            f"{(err.stdout or b'')[-1000:]!r} {(err.stderr or b'')[-1000:]!r}"
        ) from None


def test_import_without_triton():
    """On a machine without triton the package imports; a kernel call says what to do."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, moestack.kernels as k\n"
        "x = torch.zeros(2, 3); w = torch.zeros(1, 3, 4)\n"
        "try:\n"
        "    k.grouped_gemm(x, w, torch.tensor([2], dtype=torch.int32))\n"
        "except ImportError as e:\n"
        "    print('IMPORT-ERROR', e)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert "IMPORT-ERROR" in out.stdout and "needs triton" in out.stdout


def test_megablocks_missing_gives_clear_error():
    pytest.importorskip("triton")
    try:
        import megablocks  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("megablocks is installed")
    from moestack.kernels import moe_experts_megablocks

    x = torch.zeros(2, 4)
    with pytest.raises(ImportError, match=r"pip install moestack\[megablocks\]"):
        moe_experts_megablocks(
            x,
            torch.zeros(1, 4, 6),
            torch.zeros(1, 3, 4),
            torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, 1),
        )


_COMPILE_PRELUDE = r"""
import os
from concurrent.futures import ThreadPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moestack.kernels import _triton as tk

def compile_for(fn, ptr, constexprs, num_warps, num_stages=3):
    sig, cx, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            cx[(i,)] = constexprs[name]
            continue
        sig[name] = "*i32" if name.startswith(("offsets", "a_rows", "b_rows", "c_rows")) else (
            "*fp32" if name.startswith(("scale", "dscale")) else ptr if name.endswith("_ptr")
            else "i32")
        attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
    except TypeError:  # another triton version's compiler API
        print("API-MISMATCH")
        raise SystemExit(0)  # re-raised in the main thread by compile_all
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))

def compile_all(launches):
    # Triton lowers and runs ptxas without the GIL: a thread per core (at most 4, for the
    # memory) compiles in parallel.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with ThreadPoolExecutor(min(cores or 1, 4)) as pool:
        return list(pool.map(lambda launch: compile_for(*launch), launches))
"""
_COMPILE_CHECK = (
    _COMPILE_PRELUDE
    + r"""

# A launch specialises integer arguments equal to 1 into constants: contiguous tensors'
# unit strides, given here as such, so that what compiles is what a real launch runs.
tiles = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, DOT_PRECISION="tf32")
unit_mm = dict(stride_ak=1, stride_bn=1, stride_cn=1, stride_zn=1)
plain = dict(DSWIGLU=False, STORE_H=False)  # no SwiGLU backward in the epilogue
fwd, _, dx, _, _, _, _ = compile_all([
    (tk.grouped_mm_kernel, "*bf16", dict(tiles, **unit_mm, GATHER_A=True, SCATTER_C=False,
     HAS_SCALE=False, SWIGLU=True, STORE_Z=True, EVEN_K=True, BLOCK_E=128, **plain), 8),
    (tk.grouped_mm_kernel, "*bf16", dict(tiles, **unit_mm, GATHER_A=False, SCATTER_C=True,
     HAS_SCALE=True, SWIGLU=False, STORE_Z=False, EVEN_K=False, BLOCK_E=128, **plain), 8),
    (tk.grouped_mm_kernel, "*bf16", dict(tiles, stride_ak=1, stride_bk=1, stride_cn=1,
     stride_zn=1, GATHER_A=False, SCATTER_C=True, HAS_SCALE=False, SWIGLU=False,
     STORE_Z=False, EVEN_K=True, BLOCK_E=128, **plain), 8),  # A @ W^T: W's K is unit
    (tk.grouped_wgrad_kernel, "*bf16", dict(tiles, stride_ak=1, stride_bn=1, stride_cn=1,
     GATHER_A=False, GATHER_B=True, EVEN_KM=False), 8),
    (tk.grouped_wgrad_kernel, "*bf16", dict(tiles, stride_ak=1, stride_bn=1, stride_cn=1,
     GATHER_A=False, GATHER_B=False, EVEN_KM=True), 8),  # the MoE backward's contiguous dW
    (tk.swiglu_bwd_kernel, "*bf16", dict(STORE_H=True, BLOCK_F=1024), 4),
    (tk.grouped_mm_kernel, "*bf16", dict(tiles, stride_ak=1, stride_bk=1, stride_cn=1,
     stride_zn=1, stride_dzn=1, GATHER_A=False, SCATTER_C=False, HAS_SCALE=False,
     SWIGLU=False, STORE_Z=False, DSWIGLU=True, STORE_H=True, EVEN_K=True, BLOCK_E=128),
     8),  # G = dy @ W2^T with the SwiGLU backward in its epilogue
])
# Software pipelining (several K tiles in flight through shared memory) is what makes the
# main loop fast: one stage of a 128x128x64 bf16 tile pair is 32 KiB.
print("SHARED", fwd.metadata.shared, dx.metadata.shared)
print("COMPILED")
"""
)


def _compile_for_sm90(code: str) -> str:
    """The output of ``code``, a child Python compiling kernels for Hopper that prints
    COMPILED when done; skips where this triton cannot compile for it."""
    pytest.importorskip("triton.backends.nvidia")
    out = _run(code)
    if "API-MISMATCH" in out.stdout:
        pytest.skip("this check speaks the triton 3.9 compiler API")
    if "COMPILED" not in out.stdout and ("ptxas" in out.stderr and "not found" in out.stderr):
        pytest.skip("no ptxas in this triton install")
    assert "COMPILED" in out.stdout, out.stderr[-3000:]
    return out.stdout


def test_kernels_compile_for_sm90():
    """The interpreter skips the compiler: compile every kernel for Hopper (no GPU needed)."""
    stdout = _compile_for_sm90(_COMPILE_CHECK)
    shared = [int(v) for v in stdout.split("SHARED", 1)[1].split()[:2]]
    assert min(shared) > 32 * 1024, f"main loops not pipelined: shared memory {shared} bytes"


# The launch variants of each kind, their flags in _CANDIDATES_CHECK, and the one that keeps
# the most tile buffers in flight: the mm variants keep the same buffers (their shared
# memory is equal at every candidate), a gathered weight gradient loses a stage to its index
# loads (less than the plain one).
VARIANTS = {
    "mm": ("fwd_down", "bwd_G", "plain"),
    "mm_swiglu": ("fwd_up",),
    "wgrad": ("gather_a", "gather_b", "plain"),
    "mm_dswiglu": ("bwd_G_dswiglu", "bwd_G_dswiglu_no_h"),
}
WIDEST = {"mm": "plain", "mm_swiglu": "fwd_up", "wgrad": "plain", "mm_dswiglu": "bwd_G_dswiglu"}


def compiled_launches() -> list[tuple[str, int, str]]:
    """(kind, candidate index, variant) of every launch the sm_90 check compiles: every
    candidate in its widest variant, and every variant at the default tile (each kind's
    first candidate) and at the weight gradient's five-stage 128x128x64 tile (the stage
    check below compares the gathered ones at three and five stages)."""
    launches = []
    for kind, cands in tuning.CANDIDATES.items():
        for i, cfg in enumerate(cands):
            tile = (kind, cfg.block_m, cfg.block_n, cfg.block_k)
            every = i == 0 or tile == ("wgrad", 128, 128, 64)
            launches += [(kind, i, name) for name in (VARIANTS[kind] if every else [WIDEST[kind]])]
    return launches


def shared_bound(kind: str, cfg: tuning.KernelConfig) -> int:
    """Bytes of shared memory no launch variant of a candidate needs more of: num_stages
    buffers of its bf16 A and B tiles (two B tiles, gate and up, for the fused SwiGLU) and of
    the int32 row indices a gathered operand loads with them (block_k token rows for the
    weight gradient, block_m rows otherwise). Computed without compiling; the test checks it
    against every launch it compiles."""
    b_tiles = 2 if kind == "mm_swiglu" else 1
    rows = cfg.block_k if kind == "wgrad" else cfg.block_m
    return cfg.num_stages * (2 * cfg.block_k * (cfg.block_m + b_tiles * cfg.block_n) + 4 * rows)


_CANDIDATES_CHECK = (
    _COMPILE_PRELUDE
    + r"""
from moestack.kernels import tuned_table, tuning

# The launch variants of the MoE layer and the plain grouped GEMM (unit strides constant).
mm_variants = {
    "fwd_down": dict(stride_ak=1, stride_bn=1, stride_cn=1, stride_zn=1, GATHER_A=False,
                     SCATTER_C=True, HAS_SCALE=True, SWIGLU=False, STORE_Z=False,
                     EVEN_K=False, DSWIGLU=False, STORE_H=False),
    "bwd_G": dict(stride_ak=1, stride_bk=1, stride_cn=1, stride_zn=1, GATHER_A=False,
                  SCATTER_C=False, HAS_SCALE=False, SWIGLU=False, STORE_Z=False, EVEN_K=True,
                  DSWIGLU=False, STORE_H=False),
    "plain": dict(stride_ak=1, stride_bn=1, stride_cn=1, stride_zn=1, GATHER_A=False,
                  SCATTER_C=False, HAS_SCALE=False, SWIGLU=False, STORE_Z=False,
                  EVEN_K=False, DSWIGLU=False, STORE_H=False),
}
dswiglu = dict(mm_variants["bwd_G"], stride_dzn=1, DSWIGLU=True, STORE_H=True)
variants = {
    "mm": mm_variants,
    "mm_swiglu": {"fwd_up": dict(mm_variants["plain"], GATHER_A=True, SWIGLU=True,
                                 STORE_Z=True)},
    "mm_dswiglu": {"bwd_G_dswiglu": dswiglu,
                   "bwd_G_dswiglu_no_h": dict(dswiglu, STORE_H=False)},
    "wgrad": {
        "gather_a": dict(stride_ak=1, stride_bn=1, stride_cn=1, GATHER_A=True, GATHER_B=False,
                         EVEN_KM=False),
        "gather_b": dict(stride_ak=1, stride_bn=1, stride_cn=1, GATHER_A=False, GATHER_B=True,
                         EVEN_KM=False),
        "plain": dict(stride_ak=1, stride_bn=1, stride_cn=1, GATHER_A=False, GATHER_B=False,
                      EVEN_KM=True),
    },
}
launches = []
for kind, index, name in LAUNCHES:
    cfg = tuning.CANDIDATES[kind][index]
    cx = dict(variants[kind][name], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
              BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, DOT_PRECISION="tf32")
    if kind != "wgrad":
        cx["BLOCK_E"] = 128
    fn = tk.grouped_wgrad_kernel if kind == "wgrad" else tk.grouped_mm_kernel
    launches.append((fn, "*bf16", cx, cfg.num_warps, cfg.num_stages))
for (kind, index, name), k in zip(LAUNCHES, compile_all(launches)):
    print("CFG", kind, name, index, k.metadata.shared)
print("COMPILED")
"""
)
SM90_SHARED_LIMIT = 232_448  # bytes of shared memory one block may use on H100/H200


def test_every_candidate_compiles_for_sm90_within_shared_memory():
    """Every candidate tile of every kind compiles for Hopper in bf16, in the launch variant
    that keeps the most tile buffers in flight (every variant at the default tile), and fits
    its shared memory in every variant (a config that cannot would only cost autotuning time
    there): as compiled, and by a bound that holds for every launch compiled. The five-stage
    weight-gradient tiles do keep one more buffer in flight than three stages."""
    launches = compiled_launches()
    stdout = _compile_for_sm90(f"LAUNCHES = {launches!r}\n" + _CANDIDATES_CHECK)
    shared = {}
    for line in stdout.splitlines():
        if line.startswith("CFG "):
            kind, name, index, nbytes = line.split()[1:]
            shared[(kind, int(index), name)] = int(nbytes)
    assert sorted(shared) == sorted(launches)
    want = {(kind, i) for kind, cands in tuning.CANDIDATES.items() for i in range(len(cands))}
    assert {key[:2] for key in shared} == want  # every candidate compiled
    assert {(kind, name) for kind, _, name in shared} == {
        (kind, name) for kind, names in VARIANTS.items() for name in names
    }  # every variant compiled
    too_big = {key: n for key, n in shared.items() if n > SM90_SHARED_LIMIT}
    assert not too_big, f"candidates over sm_90's shared memory: {too_big}"
    bounds = {(k, i): shared_bound(k, c) for k, cands in tuning.CANDIDATES.items()
              for i, c in enumerate(cands)}  # fmt: skip
    over_bound = {key: (n, bounds[key[:2]]) for key, n in shared.items() if n > bounds[key[:2]]}
    assert not over_bound, f"compiled above shared_bound (bytes, bound): {over_bound}"
    too_big = {key: n for key, n in bounds.items() if n > SM90_SHARED_LIMIT}
    assert not too_big, f"candidates whose variants may exceed sm_90's shared memory: {too_big}"
    tiles = [(c.block_m, c.block_n, c.block_k, c.num_stages) for c in tuning.CANDIDATES["wgrad"]]
    at_three, at_five = (tiles.index((128, 128, 64, stages)) for stages in (3, 5))
    for gathered in ("gather_a", "gather_b"):
        three = shared[("wgrad", at_three, gathered)]
        five = shared[("wgrad", at_five, gathered)]
        stage = (128 * 64 + 64 * 128) * 2  # one bf16 A and B tile
        assert three < 3 * stage <= five < 101_376, (gathered, three, five)  # fits 99 KiB
