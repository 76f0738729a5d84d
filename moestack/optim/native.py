"""The fused host step as a small C++ kernel, built with the system compiler at first use.

Why: torch.compile's CPU code for the fused step (:mod:`moestack.optim.fused`) reloads its
scalar coefficients on every vector iteration (its pointers are not ``restrict``) and cannot
stream its stores: 0.69x of torch's fused in-place AdamW on one thread of the development
machine, where this kernel reaches 1.08x (BENCHMARKS.md). With AVX-512 the loops are
written with intrinsics: the split master's join and split (bf16 weights plus int16
remainders, :mod:`moestack.optim.split_master`), non-temporal stores for narrowed weights
that are written once and not read first, and software prefetch on every stream; otherwise
the compiler vectorises plain C++.

The source below is plain C++ with OpenMP, no torch headers, so it builds in well under a
second; it is loaded with ctypes after torch, and resolves ``libgomp.so.1`` to the copy torch
already loaded, so it shares torch's OpenMP runtime and takes ``torch.get_num_threads()``
threads. The library is cached in ``$MOESTACK_KERNEL_CACHE``, else in
``moestack/kernels`` under ``$XDG_CACHE_HOME`` (when absolute) or ``~/.cache``, keyed by the
source, the flags, the compiler and the CPU's flags (it is built with ``-march=native``);
``$CXX`` names the compiler (default ``g++``).

Only a library this user's process built is loaded (:func:`cache_dir`, :func:`_verified`):
the cache folder must belong to this user and be writable by no one else (else the library
is built in a private temporary folder for this process, with one warning), and the
library, opened once and hashed through that descriptor, must be a file of ours alone with
the sha256 recorded next to it (``<library>.sha256``) when it was built; it is loaded through
the same descriptor. One that is not (planted, truncated, flipped, writable by others) is
rebuilt, with one logged line, before anything of it runs.

One call steps many contiguous segments: the elements of all segments, concatenated, go to
the threads in chunks of 64K elements, each to the next free thread. :meth:`NativeKernel.prepare` turns the
segments into the pointer arrays the call takes once; a step whose slices have not moved
reuses them (:class:`moestack.optim.fused.FusedHostStep`), so the Python around the kernel
stays a small fraction of a step.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from moestack import user_cache
from moestack.atomic import fsync_dir

log = logging.getLogger(__name__)

FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffp-contract=off",  # no fused multiply-adds: the same roundings as torch's eager ops
    "-fno-math-errno",  # lets sqrt vectorise; IEEE results are unchanged
    "-fPIC",
    "-shared",
    "-std=c++17",
)

SOURCE = r"""
// moestack: the fused AdamW host step (moestack/optim/native.py builds and loads it).
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

inline float widen(float f) { return f; }
inline float widen(uint16_t b) {  // bfloat16 -> float: exact
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t narrow(float f) {  // float -> bfloat16, nearest even, as torch
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0)
                                          : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline void put(float* p, int64_t i, float f) { p[i] = f; }
inline void put(uint16_t* p, int64_t i, float f) { p[i] = narrow(f); }

// A split master weight: the bfloat16 weight hi = x.to(bfloat16) and the 16-bit remainder
// lo = bits(x) - bits(hi) << 16, which nearest-even rounding keeps in [-0x8000, 0x8000]. The
// one value int16 cannot hold, +0x8000 (an exact tie rounded down to an even hi), is stored
// as 0x7fff: the master moves one ulp towards hi, which still rounds to hi.
// A remainder below zero cannot belong to a zero hi, nor one above zero to an infinite hi
// (either would join to a NaN): that happens when the weights were written to from outside
// since the last step (direct mode, where hi is the parameter); the remainder is taken as 0.
inline float join(uint16_t hi, int16_t lo) {
  const uint32_t mag = hi & 0x7fffu;
  const int32_t l = (mag == 0 && lo < 0) || (mag == 0x7f80u && lo > 0) ? 0 : int32_t(lo);
  const uint32_t u = (uint32_t(hi) << 16) + uint32_t(l);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline int16_t remainder_of(float x, uint16_t hi) {  // the low 16 bits when x is a NaN:
  uint32_t u;                                        // hi is 0x7fc0, any join is a NaN
  std::memcpy(&u, &x, 4);
  const int32_t d = int32_t(u - (uint32_t(hi) << 16));
  return int16_t(uint16_t(uint32_t(d > 0x7fff ? 0x7fff : d)));
}

struct Coef {  // see moestack/optim/fused.py: coefficients()
  float decay, w1, beta2, w2, bc2_sqrt, eps, neg_step, scale;
};

// One pass over [a, b): read g, the master (x, or hi in out and lo in x when X is int16_t), m
// and v; write them back and, unless O is void, the narrowed weight (vectorised by the
// compiler).
template <typename X, typename G, typename S, typename O>
void update(X* __restrict x, const G* __restrict g, S* __restrict m, S* __restrict v,
            O* __restrict out, const Coef c, int64_t a, int64_t b) {
  constexpr bool split = std::is_same_v<X, int16_t>;
#pragma omp simd
  for (int64_t i = a; i < b; ++i) {
    const float gi = widen(g[i]) * c.scale;
    const float mo = widen(m[i]);
    const float vo = widen(v[i]);
    float x0;
    if constexpr (split) x0 = join(out[i], x[i]);
    else x0 = x[i];
    const float mi = mo + c.w1 * (gi - mo);
    const float vi = vo * c.beta2 + c.w2 * gi * gi;
    const float xi = x0 * c.decay + c.neg_step * mi / (std::sqrt(vi) / c.bc2_sqrt + c.eps);
    put(m, i, mi);
    put(v, i, vi);
    if constexpr (split) {
      const uint16_t hi = narrow(xi);
      out[i] = hi;
      x[i] = remainder_of(xi, hi);
    } else {
      x[i] = xi;
      if constexpr (!std::is_void_v<O>) put(out, i, xi);
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The same arithmetic, 16 lanes at a time, written out by hand: so that narrowed weights of
// an fp32 master can go to memory with non-temporal stores (written once and not read again
// this step, they need not be read first (write-allocate) nor kept in cache), and so that a
// split master's join and split stay in vector registers.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m256i narrow16(__m512 f) {  // as narrow(): nearest even, NaN -> 0x7fc0
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_ORD_Q), _mm512_set1_epi32(0x7fc0), r);
  return _mm512_cvtepi32_epi16(r);
}
inline void store16(float* p, __m512 f) { _mm512_storeu_ps(p, f); }
inline void store16(uint16_t* p, __m512 f) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow16(f));
}
inline __m512 join16(const uint16_t* hi, const int16_t* lo) {  // as join()
  const __m512i h = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi))), 16);
  __m512i l = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)));
  const __m512i mag = _mm512_and_si512(h, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 zero = _mm512_test_epi32_mask(mag, mag) ^ __mmask16(0xffff);
  const __mmask16 inf = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f800000));
  l = _mm512_mask_max_epi32(l, zero, l, _mm512_setzero_si512());
  l = _mm512_mask_min_epi32(l, inf, l, _mm512_setzero_si512());
  return _mm512_castsi512_ps(_mm512_add_epi32(h, l));
}
inline void split16(uint16_t* hi, int16_t* lo, __m512 x) {  // as narrow(), remainder_of()
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  h = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), _mm512_set1_epi32(0x7fc0), h);
  const __m512i d = _mm512_min_epi32(_mm512_sub_epi32(u, _mm512_slli_epi32(h, 16)),
                                     _mm512_set1_epi32(0x7fff));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), _mm512_cvtepi32_epi16(h));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), _mm512_cvtepi32_epi16(d));
}

// The new weight of 16 lanes from the old x0; stores the moments.
template <typename G, typename S>
inline __m512 step16(__m512 x0, const G* g, S* m, S* v, const Coef& c) {
  const __m512 gi = _mm512_mul_ps(load16(g), _mm512_set1_ps(c.scale));
  const __m512 mo = load16(m), vo = load16(v);
  const __m512 mi = _mm512_add_ps(mo, _mm512_mul_ps(_mm512_set1_ps(c.w1), _mm512_sub_ps(gi, mo)));
  const __m512 vi = _mm512_add_ps(_mm512_mul_ps(vo, _mm512_set1_ps(c.beta2)),
                                  _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(c.w2), gi), gi));
  const __m512 den = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), _mm512_set1_ps(c.bc2_sqrt)),
                                   _mm512_set1_ps(c.eps));
  const __m512 xi = _mm512_add_ps(_mm512_mul_ps(x0, _mm512_set1_ps(c.decay)),
                                  _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c.neg_step), mi), den));
  store16(m, mi);
  store16(v, vi);
  return xi;
}

inline void stream32(float* out, __m512 lo, __m512 hi) {
  _mm512_stream_ps(out, lo);
  _mm512_stream_ps(out + 16, hi);
}
inline void stream32(uint16_t* out, __m512 lo, __m512 hi) {
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(narrow16(lo)), narrow16(hi), 1);
  _mm512_stream_si512(reinterpret_cast<__m512i*>(out), both);
}

// Software prefetch PREFETCH elements ahead of the loop, every line of every stream read: the
// split master reads five streams, more than one core's hardware prefetchers keep ahead of
// on their own (measured: 0.99x of torch's kernel on one thread without, 1.15x with; the
// fp32 master without an output 1.04x and 1.08x).
constexpr int64_t PREFETCH = 512;
template <typename T>
inline void prefetch_lines(const T* p) {  // the lines holding p[0:32]
  for (int64_t k = 0; k < 32; k += 64 / int64_t(sizeof(T)))
    _mm_prefetch(reinterpret_cast<const char*>(p + k), _MM_HINT_T0);
}
template <typename X, typename G, typename S, typename O>
inline void prefetch32(const X* x, const G* g, const S* m, const S* v, const O* out) {
  prefetch_lines(x);
  prefetch_lines(g);
  prefetch_lines(m);
  prefetch_lines(v);
  prefetch_lines(out);
}

template <typename X, typename G, typename S, typename O>
void run(X* __restrict x, const G* __restrict g, S* __restrict m, S* __restrict v,
         O* __restrict out, const Coef c, int64_t a, int64_t b) {
  if constexpr (std::is_same_v<X, int16_t>) {  // split master: hi is read and written back
    int64_t i = a;
    for (; i + 32 <= b; i += 32) {  // two vectors at a time, as below: more work in flight
      if (i + PREFETCH + 32 <= b) prefetch32(x + i + PREFETCH, g + i + PREFETCH, m + i + PREFETCH, v + i + PREFETCH, out + i + PREFETCH);
      const __m512 lo = step16(join16(out + i, x + i), g + i, m + i, v + i, c);
      const __m512 hi = step16(join16(out + i + 16, x + i + 16), g + i + 16, m + i + 16, v + i + 16, c);
      split16(out + i, x + i, lo);
      split16(out + i + 16, x + i + 16, hi);
    }
    update(x, g, m, v, out, c, i, b);
  } else if constexpr (std::is_void_v<O>) {  // the compiler's vector loop, 32 at a time
    int64_t i = a;
    for (; i + 32 <= b; i += 32) {
      if (i + PREFETCH + 32 <= b) prefetch32(x + i + PREFETCH, g + i + PREFETCH, m + i + PREFETCH, v + i + PREFETCH, x + i + PREFETCH);
      update<X, G, S, O>(x, g, m, v, nullptr, c, i, i + 32);
    }
    update<X, G, S, O>(x, g, m, v, nullptr, c, i, b);
  } else {  // a head up to a 64-byte boundary of out, 32 lanes at a time, a tail
    const int64_t lead = ((64 - int64_t(reinterpret_cast<uintptr_t>(out + a) & 63)) & 63) / int64_t(sizeof(O));
    int64_t i = a + lead < b ? a + lead : b;
    update(x, g, m, v, out, c, a, i);
    for (; i + 32 <= b; i += 32) {
      if (i + PREFETCH + 32 <= b) prefetch32(x + i + PREFETCH, g + i + PREFETCH, m + i + PREFETCH, v + i + PREFETCH, x + i + PREFETCH);
      const __m512 lo = step16(_mm512_loadu_ps(x + i), g + i, m + i, v + i, c);
      const __m512 hi = step16(_mm512_loadu_ps(x + i + 16), g + i + 16, m + i + 16, v + i + 16, c);
      _mm512_storeu_ps(x + i, lo);
      _mm512_storeu_ps(x + i + 16, hi);
      stream32(out + i, lo, hi);
    }
    update(x, g, m, v, out, c, i, b);
  }
}
#else
template <typename X, typename G, typename S, typename O>
void run(X* __restrict x, const G* __restrict g, S* __restrict m, S* __restrict v,
         O* __restrict out, const Coef c, int64_t a, int64_t b) {
  update<X, G, S, O>(x, g, m, v, out, c, a, b);
}
#endif

template <typename G, typename S>
void by_out(const int64_t* p, const int32_t* k, const Coef& c, int64_t a, int64_t b) {
  const G* g = reinterpret_cast<const G*>(p[1]);
  S* m = reinterpret_cast<S*>(p[2]);
  S* v = reinterpret_cast<S*>(p[3]);
  if (k[3] == 1) {  // split master: x holds lo, out holds hi
    run(reinterpret_cast<int16_t*>(p[0]), g, m, v, reinterpret_cast<uint16_t*>(p[4]), c, a, b);
    return;
  }
  float* x = reinterpret_cast<float*>(p[0]);
  if (k[2] == 1) run(x, g, m, v, reinterpret_cast<float*>(p[4]), c, a, b);
  else if (k[2] == 2) run(x, g, m, v, reinterpret_cast<uint16_t*>(p[4]), c, a, b);
  else run<float, G, S, void>(x, g, m, v, nullptr, c, a, b);
}

void segment(const int64_t* p, const int32_t* k, const float* coef, int64_t a, int64_t b) {
  Coef c;
  std::memcpy(&c, coef, sizeof(Coef));
  if (k[0] == 0 && k[1] == 0) by_out<float, float>(p, k, c, a, b);
  else if (k[0] == 0) by_out<float, uint16_t>(p, k, c, a, b);
  else if (k[1] == 0) by_out<uint16_t, float>(p, k, c, a, b);
  else by_out<uint16_t, uint16_t>(p, k, c, a, b);
}

}  // namespace

// ptrs: [nseg, 6] (x, g, m, v, out or 0, numel); kinds: [nseg, 4] (g, moments: 0 float32,
// 1 bfloat16; out: 0 none, 1 float32, 2 bfloat16; master: 0 float32 in x, 1 split: lo
// (int16) in x and hi in out, which must be bfloat16); coefs: [nseg, 8]. Returns 0, or -1
// for a kind out of range (nothing is written then).
extern "C" int moestack_fused_adamw(const int64_t* ptrs, const int32_t* kinds,
                                    const float* coefs, int64_t nseg, int nthreads) {
  int64_t total = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    const int32_t* k = kinds + 4 * s;
    if (k[0] < 0 || k[0] > 1 || k[1] < 0 || k[1] > 1 || k[2] < 0 || k[2] > 2) return -1;
    if (k[3] < 0 || k[3] > 1 || (k[3] == 1 && k[2] != 2)) return -1;
    total += ptrs[6 * s + 5];
  }
  if (nthreads < 1 || total < (int64_t(1) << 15)) nthreads = 1;
  // The concatenated segments in chunks of CHUNK elements, each taken by the next free
  // thread: the threads stream through neighbouring memory, and one that the machine slows
  // (a shared core) takes fewer chunks instead of holding the others up at the end. Each
  // element is computed the same whichever thread takes it, so results do not depend on the
  // split. Measured against one contiguous range per thread: 2-5% faster on two threads.
  const int64_t CHUNK = int64_t(1) << 16;
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    int64_t s = 0, base = 0;  // the segment holding the chunk's start, and where it starts
    for (int64_t lo = next.fetch_add(CHUNK, std::memory_order_relaxed); lo < total;
         lo = next.fetch_add(CHUNK, std::memory_order_relaxed)) {  // increasing per thread
      const int64_t hi = lo + CHUNK < total ? lo + CHUNK : total;
      while (base + ptrs[6 * s + 5] <= lo) base += ptrs[6 * s++ + 5];
      for (int64_t j = s, start = base; j < nseg && start < hi; start += ptrs[6 * j++ + 5]) {
        const int64_t len = ptrs[6 * j + 5];
        const int64_t a = lo > start ? lo - start : 0;
        const int64_t b = hi - start < len ? hi - start : len;
        if (a < b) segment(ptrs + 6 * j, kinds + 4 * j, coefs + 8 * j, a, b);
      }
    }
#if defined(__x86_64__) || defined(__i386__)
    _mm_sfence();  // the streamed stores are visible before the step returns
#endif
  }
  return 0;
}
"""

_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_OUT_KINDS = {torch.float32: 1, torch.bfloat16: 2}


class Seg(NamedTuple):
    """One contiguous slice of the step: 1-D CPU tensors of equal length, and 8 coefficients.

    ``x`` is the fp32 master, or, for a split master, its int16 low halves (see
    :func:`moestack.optim.fused.join_master`), with the bf16 weights in ``out`` read and
    written; ``g`` the gradient (fp32 or bf16); ``m``/``v`` the moments (both fp32 or both
    bf16); ``out`` receives the updated weight in its dtype (fp32 or bf16), or is None.
    ``coef`` is :func:`moestack.optim.fused.coefficients`.
    """

    x: Tensor
    g: Tensor
    m: Tensor
    v: Tensor
    out: Tensor | None
    coef: tuple[float, ...]


class Prepared(NamedTuple):
    """Segments as the kernel takes them: pointers and lengths, dtype kinds (see SOURCE)."""

    ptrs: ctypes.Array
    kinds: ctypes.Array
    nseg: int


class NativeKernel:
    """The loaded library's step: one call for a list of :class:`Seg`."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fn = lib.moestack_fused_adamw
        self._fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int]
        self._fn.restype = ctypes.c_int

    def __call__(self, segs: Sequence[Seg]) -> None:
        """Step every segment (all threads of torch's pool, one pass over memory)."""
        self.run(self.prepare(segs), [s.coef for s in segs])

    @staticmethod
    def prepare(segs: Sequence[Seg]) -> Prepared:
        """Check the segments (:func:`check_seg`) and build the arrays the kernel reads; valid
        while the tensors stay where they are. ctypes arrays: a few microseconds, where
        torch.tensor takes tens."""
        ptrs: list[int] = []
        kinds: list[int] = []
        for s in segs:
            n = check_seg(s)
            out = s.out
            ptrs += (s.x.data_ptr(), s.g.data_ptr(), s.m.data_ptr(), s.v.data_ptr())
            ptrs += (0 if out is None or not n else out.data_ptr(), n)
            split = int(s.x.dtype == torch.int16)
            kinds += (_KINDS[s.g.dtype], _KINDS[s.m.dtype], _out_kind(out), split)
        p = (ctypes.c_int64 * len(ptrs))(*ptrs)
        k = (ctypes.c_int32 * len(kinds))(*kinds)
        return Prepared(p, k, len(segs))

    def run(self, prepared: Prepared, coefs: Sequence[tuple[float, ...]]) -> None:
        """Step prepared segments with one coefficient tuple each."""
        if len(coefs) != prepared.nseg:
            raise ValueError(f"{len(coefs)} coefficient tuples for {prepared.nseg} segments")
        if not prepared.nseg:
            return
        first = tuple(coefs[0])
        if coefs.count(first) == len(coefs):  # one step count, one schedule: the usual case
            flat: Sequence[float] = first * prepared.nseg
        else:
            flat = [value for coef in coefs for value in coef]
        if len(flat) != 8 * prepared.nseg:
            raise ValueError(f"each segment takes 8 coefficients, got {[len(c) for c in coefs]}")
        c = (ctypes.c_float * len(flat))(*flat)
        rc = self._fn(prepared.ptrs, prepared.kinds, c, prepared.nseg, torch.get_num_threads())
        if rc != 0:  # pragma: no cover - check_seg refuses what the kernel would
            raise RuntimeError(f"moestack_fused_adamw returned {rc}")


def _out_kind(out: Tensor | None) -> int:
    return 0 if out is None else _OUT_KINDS[out.dtype]


def check_seg(s: Seg) -> int:
    """The segment's length; ValueError unless the kernel can take it (it gets raw pointers)."""
    n = s.x.numel()
    split = s.x.dtype == torch.int16 and s.out is not None and s.out.dtype == torch.bfloat16
    ok = (
        (s.x.dtype == torch.float32 or split)
        and s.g.dtype in _KINDS
        and s.m.dtype in _KINDS
        and s.v.dtype == s.m.dtype
        and (s.out is None or s.out.dtype in _OUT_KINDS)
        and len(s.coef) == 8
    )
    for t in (s.x, s.g, s.m, s.v, s.out):
        if t is not None:
            ok = ok and t.device.type == "cpu" and t.is_contiguous() and t.numel() == n
    if not ok:
        tensors = [t for t in s[:5] if t is not None]
        desc = [(tuple(t.shape), t.dtype, t.device.type, t.is_contiguous()) for t in tensors]
        raise ValueError(f"fused step: segment the kernel cannot take: {desc}")
    return n


def load(extra_flags: Sequence[str] = ()) -> NativeKernel:
    """Build (or find in the cache) and load the library; raise RuntimeError if impossible.

    Only a library this user's process built is loaded: one that is missing, damaged, planted
    or that others can write is rebuilt first (:func:`_verified`). ``extra_flags`` go after
    :data:`FLAGS` (the tests build the portable loops, without the AVX-512 ones, with
    ``-mno-avx512f``)."""
    cxx = find_compiler()
    if not cxx:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    flags = (*FLAGS, *extra_flags)
    path = cache_dir() / f"fused_adamw_{_key(cxx, flags)}.so"
    fd, digest = _verified_or_built(cxx, path, flags)
    return NativeKernel(_dlopen(fd, digest), path)


def find_compiler() -> str | None:
    """The C++ compiler the kernel is built with: ``$CXX``, else ``g++`` or ``c++`` on the
    PATH; None when there is none."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def compiler_version(cxx: str) -> str:
    """The first line of ``cxx --version``, or why it could not be run."""
    try:
        proc = subprocess.run(
            [*shlex.split(cxx), "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as err:
        return f"does not run: {type(err).__name__}: {err}"
    lines = (proc.stdout or proc.stderr).strip().splitlines()
    return lines[0] if lines else f"--version exited with {proc.returncode}"


def is_private(path: Path) -> bool:
    """Whether ``path`` is in a private folder of this process, used in place of a refused
    cache folder (it is removed when the process exits)."""
    return path.parent in _PRIVATE.values()


# ------------------------------------------------------------- the cache and what it holds
# Who may have written a file decides whether it may run in this process: the cache folder
# and each file loaded from it must belong to this user and be writable by no one else, and
# a library's bytes must have the sha256 recorded (in ``<library>.sha256``) when it was built.

_DIGEST_SUFFIX = ".sha256"
_PRIVATE: dict[Path, Path] = {}  # refused cache folder -> this process's private folder
_LOADED: dict[str, ctypes.CDLL] = {}  # sha256 -> the library loaded with those bytes


_Refused = user_cache.NotPrivate  # a cache folder or file not loaded from; says why
_ENV = "MOESTACK_KERNEL_CACHE"


def cache_folder() -> Path:
    """The cache folder the environment names (:func:`moestack.user_cache.cache_folder`):
    ``$MOESTACK_KERNEL_CACHE``, else ``moestack/kernels`` under the user's cache."""
    return user_cache.cache_folder(_ENV, "kernels")


def cache_dir() -> Path:
    """The folder libraries are built in and loaded from: :func:`cache_folder` (resolved)
    when it is this user's alone (:func:`moestack.user_cache.private_folder`), else a private
    folder of this process, with one warning naming the folder refused and why."""
    try:
        folder = cache_folder()
    except _Refused as err:
        raise RuntimeError(f"{err}: set {_ENV}") from None
    if folder in _PRIVATE:
        return _PRIVATE[folder]
    try:
        return user_cache.private_folder(folder)
    except _Refused as err:
        why = str(err)
    try:
        private = Path(tempfile.mkdtemp(prefix="moestack-kernels-"))  # 0o700, a new name
    except OSError as err:
        msg = f"kernel cache {folder} refused ({why}); no private folder: {err}"
        raise RuntimeError(msg) from None
    atexit.register(shutil.rmtree, private, True)
    _PRIVATE[folder] = private
    log.warning(
        "fused step: kernel cache %s refused (%s; set %s to a folder only this user can "
        "write); building in %s for this process",
        folder,
        why,
        _ENV,
        private,
    )
    return private


def _open_own(path: Path) -> int:
    """``path`` opened to read, not through a symbolic link; FileNotFoundError if missing,
    _Refused unless it is a regular file that is ours alone (``user_cache.not_ours_alone``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as err:
        why = "a symbolic link" if err.errno == errno.ELOOP else err.strerror
        raise _Refused(f"cannot open {path.name}: {why}") from None
    st = os.fstat(fd)
    problem = (
        "not a regular file" if not stat.S_ISREG(st.st_mode) else user_cache.not_ours_alone(st)
    )
    if problem:
        os.close(fd)
        raise _Refused(f"{path.name} is {problem}")
    return fd


def _sha256_of(fd: int) -> str:
    """The sha256 of the whole file open at ``fd`` (read through it, from the start)."""
    h = hashlib.sha256()
    offset = 0
    while block := os.pread(fd, 1 << 20, offset):
        h.update(block)
        offset += len(block)
    return h.hexdigest()


def _recorded_sha256(path: Path) -> str:
    """The sha256 recorded for the library ``path`` when it was built; _Refused if none."""
    record = path.with_name(path.name + _DIGEST_SUFFIX)
    try:
        fd = _open_own(record)
    except FileNotFoundError:
        raise _Refused(f"no sha256 recorded for it ({record.name} is missing)") from None
    try:
        text = os.pread(fd, 256, 0).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise _Refused(f"{record.name} holds no sha256")
    return text


def _verified(path: Path) -> tuple[int, str]:
    """The library ``path`` opened, checked and hashed through one descriptor (so what is
    loaded is what was checked), and its sha256. FileNotFoundError if it is missing;
    _Refused unless it is ours alone and its bytes have the sha256 recorded at build."""
    fd = _open_own(path)
    try:
        recorded = _recorded_sha256(path)
        actual = _sha256_of(fd)
        if actual != recorded:
            raise _Refused(f"its sha256 is not the one recorded when it was built ({recorded})")
    except BaseException:
        os.close(fd)
        raise
    return fd, actual


def _verified_or_built(cxx: str, path: Path, flags: Sequence[str]) -> tuple[int, str]:
    """:func:`_verified` of ``path``, building the library first where there is none that
    verifies (saying why, in one line, when one is there). The build holds the folder's lock:
    another process that finds the library missing or half-installed waits, then loads it."""
    try:
        return _verified(path)
    except (FileNotFoundError, _Refused):
        pass
    with _locked(path.parent):
        try:
            return _verified(path)
        except FileNotFoundError:
            pass
        except _Refused as err:
            log.warning("fused step: not loading %s (%s); rebuilding it", path, err)
        _build(cxx, path, flags)
        try:
            return _verified(path)
        except (FileNotFoundError, _Refused) as err:
            raise RuntimeError(f"{path}: the library just built does not verify: {err}") from None


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold the cache folder's build lock (``.lock`` in it) for the ``with`` block."""
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _dlopen(fd: int, digest: str) -> ctypes.CDLL:
    """Load the library open at ``fd`` (checked: :func:`_verified`) through the descriptor,
    ``/proc/self/fd/<fd>``: the file that was checked, not what its name points to by now.
    The descriptor stays open: the dynamic loader knows a library by the name it was loaded
    under, and a closed descriptor's number would name another library later."""
    if digest in _LOADED:  # the same bytes are loaded already
        os.close(fd)
        return _LOADED[digest]
    name = f"/proc/self/fd/{fd}"
    try:
        if not os.path.exists(name):
            raise OSError("no /proc/self/fd to load the checked library through (Linux only)")
        lib = ctypes.CDLL(name)
    except OSError as err:
        os.close(fd)
        raise RuntimeError(f"cannot load the fused step's library: {err}") from None
    _LOADED[digest] = lib
    return lib


def _build(cxx: str, path: Path, flags: Sequence[str] = FLAGS) -> None:
    """Compile SOURCE into ``path`` and record its sha256 in ``<path>.sha256``, each moved
    into place whole (mode 0o700 and 0o600); the caller holds the folder's lock."""
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src = Path(tmp) / "fused_adamw.cpp"
        src.write_text(SOURCE)
        lib = Path(tmp) / path.name
        try:
            proc = subprocess.run(
                [*shlex.split(cxx), *flags, str(src), "-o", str(lib)],
                capture_output=True,
                text=True,
                timeout=300,
            )
        except (OSError, subprocess.SubprocessError) as err:
            raise RuntimeError(f"{cxx} failed to run: {err}") from err
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"{cxx} exited with {proc.returncode}: {last}")
        digest = _finish(lib, 0o700)
        record = Path(tmp) / (path.name + _DIGEST_SUFFIX)
        record.write_text(digest + "\n")
        _finish(record, 0o600)
        os.replace(lib, path)
        os.replace(record, path.with_name(record.name))
        fsync_dir(path.parent)
    log.info("fused step: built %s (sha256 %s)", path, digest)


def _finish(path: Path, mode: int) -> str:
    """Give the new file ``path`` its mode, fsync it and return its sha256."""
    os.chmod(path, mode)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        return _sha256_of(fd)
    finally:
        os.close(fd)


def _key(cxx: str, flags: Sequence[str] = FLAGS) -> str:
    """A digest of what the library depends on: source, flags, compiler, CPU features."""
    h = hashlib.sha256()
    for part in (SOURCE, " ".join(flags), cxx, platform.machine(), _cpu_flags()):
        h.update(part.encode())
        h.update(b"\0")
    try:
        version = subprocess.run(
            [*shlex.split(cxx), "--version"], capture_output=True, text=True, timeout=30
        )
        h.update(version.stdout.encode())
    except (OSError, subprocess.SubprocessError):
        pass  # the build reports a missing compiler
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` builds for them), or "" where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
