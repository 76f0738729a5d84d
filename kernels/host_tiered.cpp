// moestack: TieredAdamW's update on the CPU (kernels/host_tiered.py builds, loads and mirrors it
// in torch ops, bit for bit). Every fp32 operation below is one of host_tiered.py's, in the same
// order, with no fused multiply-add (built with -ffp-contract=off); every sum is the halving
// tree of tree() (x[k] + x[k + ceil(n/2)], until one is left), so no result depends on the
// vector width, the thread count or which thread takes a row.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>
#include <omp.h>

namespace {

// Per tensor, kernel's int64 fields (host_tiered.py: _FIELDS) and float coefficients (_COEFS).
enum { W, G, M, V, ROW, COL, MASTER, KEYS, UNITS, LEAD, R, C, KINDS, STATS, NI };
enum { B1C, B2, KR, KC, EPS, KBIAS, DECAY, NEGLR, THRESH, SQRTN, B2C, RF, NC };

inline float widen(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t narrow(float f) {  // float -> bfloat16, nearest even, as torch
  const uint32_t u = bits(f);
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0)
                                          : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline uint32_t mix32(uint32_t x) {  // both multipliers below 2^31: torch's int64 does the same
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x5bd1e995u;
  x ^= x >> 16;
  return x;
}

// The halving tree of N values (any N >= 1) in x (overwritten), every level at a size known
// here: a level's loop costs a set-up otherwise, as much as the adds of a short row's tree.
template <int N>
struct Fixed {
  static float sum(float* x) {
    constexpr int half = N / 2, h = N - half;
    for (int k = 0; k < half; ++k) x[k] = x[k] + x[k + h];
    return Fixed<h>::sum(x);
  }
};
template <>
struct Fixed<1> {
  static float sum(float* x) { return x[0]; }
};

constexpr int64_t FIXED = 64;  // trees of up to this many values are taken by Fixed<n>

template <int... N>
constexpr std::array<float (*)(float*), sizeof...(N)> fixed_table(std::integer_sequence<int, N...>) {
  return {{&Fixed<N + 1>::sum...}};
}
constexpr auto FIXED_SUMS = fixed_table(std::make_integer_sequence<int, FIXED>());

// The halving tree of n >= 1 values in x (overwritten); its sum.
inline float tree(float* x, int64_t n) {
  while (n > FIXED) {
    const int64_t half = n / 2, h = n - half;
#pragma omp simd
    for (int64_t k = 0; k < half; ++k) x[k] = x[k] + x[k + h];
    n = h;
  }
  return n >= 1 ? FIXED_SUMS[size_t(n - 1)](x) : 0.0f;
}

// A row of n elements of kind (0 float32, 1 bfloat16) at p + off, as floats in out.
inline void load(const void* p, int kind, int64_t off, int64_t n, float* out) {
  if (kind == 0) {
    std::memcpy(out, static_cast<const float*>(p) + off, size_t(n) * 4);
  } else {
    const uint16_t* q = static_cast<const uint16_t*>(p) + off;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] = widen(q[j]);
  }
}

// A row of n elements of kind at p + off, as floats: in place for float32, else widened in buf.
inline const float* row_of(const void* p, int kind, int64_t off, int64_t n, float* buf) {
  if (kind == 0) return static_cast<const float*>(p) + off;
  load(p, kind, off, n, buf);
  return buf;
}

// Sum of squares of one row (tree over its squares); buf holds n floats.
inline float row_sq(const float* x, int64_t n, float* buf) {
  if (n == 0) return 0.0f;
  const int64_t half = n / 2, h = n - half;
#pragma omp simd
  for (int64_t k = 0; k < half; ++k) buf[k] = x[k] * x[k] + x[k + h] * x[k + h];
  if (h > half) buf[half] = x[half] * x[half];
  return tree(buf, h);
}

struct Tensor {
  const int64_t* f;
  const float* c;
  int gk, wk, mk, factored, stochastic;
  int64_t units, lead, rows, cols, per_unit_mats, unit_rows;
};

inline Tensor describe(const int64_t* f, const float* c) {
  Tensor t{f, c, 0, 0, 0, 0, 0, f[UNITS], f[LEAD], f[R], f[C], 0, 0};
  const int64_t k = f[KINDS];
  t.gk = int(k & 3);
  t.wk = int((k >> 2) & 3);
  t.mk = int((k >> 4) & 3);
  t.factored = int((k >> 6) & 1);
  t.stochastic = int((k >> 7) & 1);
  t.per_unit_mats = t.units > 0 ? t.lead / t.units : 0;  // units < 1 refused by the caller
  t.unit_rows = t.per_unit_mats * t.rows;
  return t;
}

// v with room for at least n values (never shrunk, so a thread's buffers, kept between calls,
// are filled with zeros once, not at every unit of another size).
template <class T>
inline void grow(std::vector<T>& v, int64_t n) {
  if (int64_t(v.size()) < n) v.resize(size_t(n));
}

struct Scratch {  // one thread's rows: g, d, u of a row; buf a tree's (a row, or a row
  std::vector<float> g, d, u, buf, col;  // statistic vector); col the column sums' tree
  void fit(int64_t cols, int64_t rows, int64_t colbuf) {
    grow(g, cols), grow(d, cols), grow(u, cols);
    grow(buf, cols > rows ? cols : rows);
    grow(col, colbuf);
  }
};

constexpr int64_t CB = 64;  // columns per block of the column sums

// Factored statistics of matrix mat (global index): rows [i0, i1) of its row means.
void rows_of(const Tensor& t, int64_t mat, int64_t i0, int64_t i1, Scratch& s) {
  float* row = reinterpret_cast<float*>(t.f[ROW]) + mat * t.rows;
  for (int64_t i = i0; i < i1; ++i) {
    load(reinterpret_cast<const void*>(t.f[G]), t.gk, (mat * t.rows + i) * t.cols, t.cols, s.g.data());
    const float sum = row_sq(s.g.data(), t.cols, s.buf.data());
    row[i] = row[i] * t.c[B2] + sum * t.c[KR];
  }
}

// Column means of matrix mat for the columns of block b (tree over the rows, per column).
void cols_of(const Tensor& t, int64_t mat, int64_t b, Scratch& s) {
  const int64_t j0 = b * CB, n = (t.cols - j0 < CB ? t.cols - j0 : CB), R_ = t.rows;
  const int64_t half = R_ / 2, h = R_ - half;
  float* buf = s.col.data();  // [h, n]
  const void* g = reinterpret_cast<const void*>(t.f[G]);
  const int64_t base = mat * R_ * t.cols + j0;
  float* a = s.g.data();
  float* z = s.d.data();
  for (int64_t i = 0; i < h; ++i) {
    load(g, t.gk, base + i * t.cols, n, a);
    if (i < half) {
      load(g, t.gk, base + (i + h) * t.cols, n, z);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) buf[i * n + j] = a[j] * a[j] + z[j] * z[j];
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) buf[i * n + j] = a[j] * a[j];
    }
  }
  for (int64_t m = h; m > 1;) {
    const int64_t mh = m / 2, mc = m - mh;
    for (int64_t i = 0; i < mh; ++i) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) buf[i * n + j] = buf[i * n + j] + buf[(i + mc) * n + j];
    }
    m = mc;
  }
  float* col = reinterpret_cast<float*>(t.f[COL]) + mat * t.cols + j0;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) col[j] = col[j] * t.c[B2] + (R_ ? buf[j] : 0.0f) * t.c[KC];
}

// The factored estimate's vectors of matrix mat: a = sqrt(row / max(mean(row), 1e-30)) and
// b = sqrt(col), into a[R] and b[C].
void vectors_of(const Tensor& t, int64_t mat, float* a, float* b, Scratch& s) {
  const float* row = reinterpret_cast<const float*>(t.f[ROW]) + mat * t.rows;
  const float* col = reinterpret_cast<const float*>(t.f[COL]) + mat * t.cols;
  std::memcpy(s.buf.data(), row, size_t(t.rows) * 4);
  float mean = tree(s.buf.data(), t.rows) / t.c[RF];
  const float scale = mean < 1e-30f ? 1e-30f : mean;
  for (int64_t i = 0; i < t.rows; ++i) a[i] = float(std::sqrt(double(row[i] / scale)));
  for (int64_t j = 0; j < t.cols; ++j) b[j] = float(std::sqrt(double(col[j])));
}

// The update of row r (of the tensor) into u; with first, the moments are stepped (and
// stored), else read as stepped. a, b: the factored vectors of the row's matrix. A factored
// denominator is computed where it is used (the same two roundings, one pass less).
void update_row(const Tensor& t, int64_t r, bool first, const float* a, const float* b, float* u,
                Scratch& s) {
  const int64_t n = t.cols, off = r * n;
  const float* g = row_of(reinterpret_cast<const void*>(t.f[G]), t.gk, off, n, s.g.data());
  float* d = s.d.data();
  const float eps = t.c[EPS], b2 = t.c[B2], b2c = t.c[B2C], kb = t.c[KBIAS], b1c = t.c[B1C];
  const float ai = t.factored ? a[r % t.rows] : 0.0f;
  if (!t.factored) {
    float* v = reinterpret_cast<float*>(t.f[V]) + off;
    if (first) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) v[j] = v[j] * b2 + (b2c * g[j]) * g[j];
    }
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) d[j] = float(std::sqrt(double(v[j]))) + eps;
  }
  if (t.mk == 0) {
    if (t.factored) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) u[j] = (g[j] / (ai * b[j] + eps)) * kb;
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) u[j] = (g[j] / d[j]) * kb;
    }
  } else if (t.mk == 1) {
    float* m = reinterpret_cast<float*>(t.f[M]) + off;
    if (first) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) m[j] = m[j] + b1c * (g[j] - m[j]);
    }
    if (t.factored) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) u[j] = (m[j] / (ai * b[j] + eps)) * kb;
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) u[j] = (m[j] / d[j]) * kb;
    }
  } else {
    uint16_t* m = reinterpret_cast<uint16_t*>(t.f[M]) + off;
    if (first) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float mo = widen(m[j]);
        m[j] = narrow(mo + b1c * (g[j] - mo));
      }
    }
    if (t.factored) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) u[j] = (widen(m[j]) / (ai * b[j] + eps)) * kb;
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) u[j] = (widen(m[j]) / d[j]) * kb;
    }
  }
}

// update_row of a factored row without momentum, then row_sq of its update, in one pass
// (each element's update squared where it is made): the same values. Returns the sum.
float plain_row(const Tensor& t, int64_t r, const float* a, const float* b, float* u, Scratch& s) {
  const int64_t n = t.cols, nh = n / 2, hn = n - nh;
  const float* g = row_of(reinterpret_cast<const void*>(t.f[G]), t.gk, r * n, n, s.g.data());
  const float ai = a[r % t.rows], eps = t.c[EPS], kb = t.c[KBIAS];
  float* buf = s.buf.data();
#pragma omp simd
  for (int64_t k = 0; k < nh; ++k) {
    const float u0 = (g[k] / (ai * b[k] + eps)) * kb;
    const float u1 = (g[k + hn] / (ai * b[k + hn] + eps)) * kb;
    u[k] = u0, u[k + hn] = u1, buf[k] = u0 * u0 + u1 * u1;
  }
  if (hn > nh) {
    const float u0 = (g[nh] / (ai * b[nh] + eps)) * kb;
    u[nh] = u0, buf[nh] = u0 * u0;
  }
  return tree(buf, hn);
}

// The new weights of row r from its update u: w = w0 * decay + u * step, written as the
// tensor asks.
void write_row(const Tensor& t, int64_t r, float step, uint32_t key, const float* u, Scratch& s) {
  const int64_t n = t.cols, off = r * n;
  const int64_t first = (r % t.unit_rows) * n;  // the row's first element within its unit
  float* master = reinterpret_cast<float*>(t.f[MASTER]);
  float* w;  // the fp32 weights: the master, fp32 weights themselves, or widened bf16 ones
  if (master) w = master + off;
  else if (t.wk == 0) w = reinterpret_cast<float*>(t.f[W]) + off;
  else {
    w = s.d.data();
    load(reinterpret_cast<const void*>(t.f[W]), t.wk, off, n, w);
  }
  const float decay = t.c[DECAY];
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) w[j] = w[j] * decay + u[j] * step;
  if (t.stochastic) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t noise = mix32(mix32(uint32_t(first + j)) ^ key) >> 16;
      const uint32_t x = bits(w[j]);
      const bool finite = (x & 0x7f800000u) != 0x7f800000u;
      w[j] = finite ? from_bits((x + noise) & 0xffff0000u) : w[j];
    }
  }
  if (t.wk == 0) {
    if (master) std::memcpy(reinterpret_cast<float*>(t.f[W]) + off, w, size_t(n) * 4);
    return;
  }
  uint16_t* p = reinterpret_cast<uint16_t*>(t.f[W]) + off;
  if (t.stochastic) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) p[j] = uint16_t(bits(w[j]) >> 16);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) p[j] = narrow(w[j]);
  }
}

// The step of a unit after its update's row sums of squares (sq): the RMS, the clip factor
// and the weights' step; the unit's statistics (its applied RMS^2, clipped or not) in stats.
float unit_step(const Tensor& t, float* sq, double* stats) {
  const float rms = std::sqrt(tree(sq, t.unit_rows)) / t.c[SQRTN];
  float factor = 1.0f;
  if (t.c[THRESH] > 0.0f) {
    const float q = rms / t.c[THRESH];
    factor = q < 1.0f ? 1.0f : q;
  }
  const double applied = double(rms / factor);
  stats[0] = applied * applied;
  stats[1] = factor > 1.0f ? 1.0 : 0.0;
  return (1.0f / factor) * t.c[NEGLR];
}

struct Unit {
  int64_t tensor, e, index;  // index: the unit's place in the per-unit statistics
};

// The factored statistics of matrix mat in one pass over its gradient: each row's sum and,
// for the columns, the first level of their trees (rows i and i + ceil(R/2) together, full
// width), then the rest of the trees in cb: the same sums as rows_of and cols_of.
void stats_alone(const Tensor& t, int64_t mat, Scratch& s, std::vector<float>& cb) {
  const int64_t R_ = t.rows, n = t.cols, half = R_ / 2, h = R_ - half;
  grow(cb, h * n);
  float* row = reinterpret_cast<float*>(t.f[ROW]) + mat * R_;
  const void* g = reinterpret_cast<const void*>(t.f[G]);
  const int64_t base = mat * R_ * n;
  for (int64_t i = 0; i < h; ++i) {
    const float* a = row_of(g, t.gk, base + i * n, n, s.g.data());
    float* c = cb.data() + i * n;
    if (i < half) {  // rows i and i + h: both rows' first tree level and the columns' at once
      const float* z = row_of(g, t.gk, base + (i + h) * n, n, s.d.data());
      const int64_t nh = n / 2, hn = n - nh;
      float* ba = s.buf.data();
      float* bz = s.u.data();
#pragma omp simd
      for (int64_t k = 0; k < nh; ++k) {
        const float a0 = a[k] * a[k], a1 = a[k + hn] * a[k + hn];
        const float z0 = z[k] * z[k], z1 = z[k + hn] * z[k + hn];
        ba[k] = a0 + a1, bz[k] = z0 + z1, c[k] = a0 + z0, c[k + hn] = a1 + z1;
      }
      if (hn > nh) {
        const float a0 = a[nh] * a[nh], z0 = z[nh] * z[nh];
        ba[nh] = a0, bz[nh] = z0, c[nh] = a0 + z0;
      }
      row[i] = row[i] * t.c[B2] + tree(ba, hn) * t.c[KR];
      row[i + h] = row[i + h] * t.c[B2] + tree(bz, hn) * t.c[KR];
    } else {
      row[i] = row[i] * t.c[B2] + row_sq(a, n, s.buf.data()) * t.c[KR];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) c[j] = a[j] * a[j];
    }
  }
  float* c = cb.data();
  for (int64_t m = h; m > 1;) {
    const int64_t mh = m / 2, mc = m - mh;
    for (int64_t i = 0; i < mh; ++i) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) c[i * n + j] = c[i * n + j] + c[(i + mc) * n + j];
    }
    m = mc;
  }
  float* col = reinterpret_cast<float*>(t.f[COL]) + mat * n;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) col[j] = col[j] * t.c[B2] + c[j] * t.c[KC];
}

struct Alone {  // one thread's buffers for whole units
  std::vector<float> ab, sq, u, cb;
};

// One unit by one thread: the statistics in one pass, the update kept (not computed twice).
void unit_alone(const Tensor& t, int64_t e, double* stats, Scratch& s, Alone& b) {
  const int64_t mats = t.per_unit_mats, m0 = e * mats, n = t.cols;
  if (t.factored) {
    grow(b.ab, mats * (t.rows + n));
    for (int64_t k = 0; k < mats; ++k) {
      stats_alone(t, m0 + k, s, b.cb);
      vectors_of(t, m0 + k, b.ab.data() + k * t.rows, b.ab.data() + mats * t.rows + k * n, s);
    }
  }
  grow(b.sq, t.unit_rows);
  grow(b.u, t.unit_rows * n);
  const int64_t r0 = e * t.unit_rows;
  for (int64_t i = 0; i < t.unit_rows; ++i) {
    const int64_t k = i / t.rows;
    float* u = b.u.data() + i * n;
    const float* va = b.ab.data() + k * t.rows;
    const float* vb = b.ab.data() + mats * t.rows + k * n;
    if (t.factored && t.mk == 0) {
      b.sq[size_t(i)] = plain_row(t, r0 + i, va, vb, u, s);
      continue;
    }
    update_row(t, r0 + i, true, va, vb, u, s);
    b.sq[size_t(i)] = row_sq(u, n, s.buf.data());
  }
  const float step = unit_step(t, b.sq.data(), stats);
  const uint32_t key = t.f[KEYS] ? reinterpret_cast<const uint32_t*>(t.f[KEYS])[e] : 0u;
  for (int64_t i = 0; i < t.unit_rows; ++i) write_row(t, r0 + i, step, key, b.u.data() + i * n, s);
}

// One unit by every thread of the team (each phase split by rows or column blocks).
void unit_together(const Tensor& t, int64_t e, double* stats, Scratch& s, float* ab, float* sq,
                   float* step) {
  const int64_t mats = t.per_unit_mats, m0 = e * mats;
  const int64_t blocks = (t.cols + CB - 1) / CB;
  if (t.factored) {
    for (int64_t k = 0; k < mats; ++k) {
#pragma omp for schedule(dynamic, 16)
      for (int64_t i = 0; i < t.rows; ++i) rows_of(t, m0 + k, i, i + 1, s);
#pragma omp for schedule(dynamic, 1)
      for (int64_t b = 0; b < blocks; ++b) cols_of(t, m0 + k, b, s);
#pragma omp single
      vectors_of(t, m0 + k, ab + k * t.rows, ab + mats * t.rows + k * t.cols, s);
    }
  }
  const int64_t r0 = e * t.unit_rows;
#pragma omp for schedule(dynamic, 16)
  for (int64_t i = 0; i < t.unit_rows; ++i) {
    const int64_t k = i / t.rows;
    update_row(t, r0 + i, true, ab + k * t.rows, ab + mats * t.rows + k * t.cols, s.u.data(), s);
    sq[i] = row_sq(s.u.data(), t.cols, s.buf.data());
  }
#pragma omp single
  *step = unit_step(t, sq, stats);
  const uint32_t key = t.f[KEYS] ? reinterpret_cast<const uint32_t*>(t.f[KEYS])[e] : 0u;
#pragma omp for schedule(dynamic, 16)
  for (int64_t i = 0; i < t.unit_rows; ++i) {
    const int64_t k = i / t.rows;
    update_row(t, r0 + i, false, ab + k * t.rows, ab + mats * t.rows + k * t.cols, s.u.data(), s);
    write_row(t, r0 + i, *step, key, s.u.data(), s);
  }
}

}  // namespace

// fields: [ntens, NI] int64 (see the enum), coefs: [ntens, NC] float; stats: [ntens, 2] double,
// each tensor's sum over its units (in order) of the applied RMS^2 and of the clipped units. Units of fewer than `together` elements are each taken whole by the
// next free thread; larger ones by all threads, phase by phase. Returns 0, or -1 for a
// descriptor out of range (nothing is written then).
extern "C" int moestack_tiered_step(const int64_t* fields, const float* coefs, double* stats,
                                    int64_t ntens, int nthreads, int64_t together) {
  std::vector<Unit> alone, shared;
  int64_t maxcols = 1, maxrows = 1, maxshared = 0, sharedrows = 0, nunits = 0;
  for (int64_t i = 0; i < ntens; ++i) {
    const Tensor t = describe(fields + NI * i, coefs + NC * i);
    if (t.gk > 1 || t.wk > 1 || t.mk > 2 || t.units < 1 || t.lead % t.units || t.rows < 1 ||
        t.cols < 1)
      return -1;
    if (t.factored ? !(t.f[ROW] && t.f[COL]) : !t.f[V]) return -1;
    if ((t.mk && !t.f[M]) || (t.stochastic && !t.f[KEYS])) return -1;
    maxcols = t.cols > maxcols ? t.cols : maxcols;
    maxrows = t.rows > maxrows ? t.rows : maxrows;
    const bool big = t.unit_rows * t.cols >= together;
    for (int64_t e = 0; e < t.units; ++e) (big ? shared : alone).push_back({i, e, nunits++});
    if (big) maxshared = std::max<int64_t>(maxshared, t.per_unit_mats * (t.rows + t.cols) + t.unit_rows);
    if (big) sharedrows = std::max<int64_t>(sharedrows, t.rows);  // cols_of's buffer: theirs alone
  }
  std::vector<float> shared_buf(size_t(maxshared) + 1);
  std::vector<double> per_unit(size_t(2 * nunits));
  float step = 0.0f;
  int64_t total = 0;
  for (int64_t i = 0; i < ntens; ++i) total += fields[NI * i + LEAD] * fields[NI * i + R] * fields[NI * i + C];
  if (nthreads < 1 || total < (int64_t(1) << 15)) nthreads = 1;
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    static thread_local Scratch s;  // kept by the thread between calls: no allocation a step
    s.fit(maxcols, maxrows, ((sharedrows + 1) / 2) * CB);
    static thread_local Alone buffers;
    for (int64_t k = next.fetch_add(1); k < int64_t(alone.size()); k = next.fetch_add(1)) {
      const Unit& u = alone[size_t(k)];
      const Tensor t = describe(fields + NI * u.tensor, coefs + NC * u.tensor);
      unit_alone(t, u.e, per_unit.data() + 2 * u.index, s, buffers);
    }
#pragma omp barrier
    for (const Unit& u : shared) {
      const Tensor t = describe(fields + NI * u.tensor, coefs + NC * u.tensor);
      float* ab_ = shared_buf.data();
      float* sq_ = ab_ + t.per_unit_mats * (t.rows + t.cols);
      unit_together(t, u.e, per_unit.data() + 2 * u.index, s, ab_, sq_, &step);
#pragma omp barrier
    }
  }
  for (int64_t i = 0, k = 0; i < ntens; ++i) {  // per tensor, its units in order
    stats[2 * i] = stats[2 * i + 1] = 0.0;
    for (int64_t e = 0; e < fields[NI * i + UNITS]; ++e, ++k) {
      stats[2 * i] += per_unit[size_t(2 * k)];
      stats[2 * i + 1] += per_unit[size_t(2 * k + 1)];
    }
  }
  return 0;
}
