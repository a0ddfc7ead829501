// The dense_linear kernel for one ISA level, included once per level by dense_linear.cpp inside
// the level's namespace (no include guard, by design) with
//   STAGEWISE_D_LEVEL   0 (baseline), 1 (AVX2), 2 (AVX-512): the Isa of cpu/isa.h;
//   STAGEWISE_D_TARGET  the function attribute of that level (empty for the baseline).
//
// A thread's output features [n0, n1) are cut into kStreams parts of consecutive rows of W; a
// tile takes the next row of every part, so the tile's rows are kStreams weight streams far
// apart in memory, each read front to back (dense_linear.cpp says why). Each row meets kMR rows
// of x at a time in kMR x kStreams vector accumulators; more rows of x take further passes over
// the tile, which is then in L2.
#define STAGEWISE_D_INLINE STAGEWISE_ALWAYS_INLINE STAGEWISE_D_TARGET

namespace STAGEWISE_D_NS {

#if STAGEWISE_D_LEVEL >= 2
constexpr int W = 16, kMR = 2;  // 16 accumulators + 2 rows of x + 1 weight vector of 32 zmm
#elif STAGEWISE_D_LEVEL == 1
constexpr int W = 8, kMR = 1;   // 8 accumulators + x + weight of 16 ymm
#else
constexpr int W = 4, kMR = 1;
#endif
constexpr int kStreams = 8;
constexpr int kLineFloats = 16;  // a 64-byte cache line: one prefetch per stream per step
typedef float VF __attribute__((vector_size(4 * W)));

STAGEWISE_D_INLINE VF load(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

STAGEWISE_D_INLINE float lane_sum(VF v) {
  float s = 0.f;
  for (int l = 0; l < W; ++l) s += v[l];
  return s;
}

// acc[i * S + j] = dot(x row i, w[j]) for i < kRows, j < S, over K inputs. With `ahead`, each
// stream's floats kAhead on (capped at ends[j], the stream's last float) are requested into L2 as
// the kernel goes.
template <int S, int kRows>
STAGEWISE_D_INLINE void tile(const float* const* w, const float* const* ends, const float* x, int64_t x_stride,
                             int64_t K, bool ahead, float* acc) {
  VF sum[kRows][S];
#pragma GCC unroll 16
  for (int i = 0; i < kRows; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < S; ++j) sum[i][j] = VF{};
  }
  const int64_t k_lines = K / kLineFloats * kLineFloats;
  for (int64_t k = 0; k < k_lines; k += kLineFloats) {
    if (ahead) {
#pragma GCC unroll 16
      for (int j = 0; j < S; ++j) __builtin_prefetch(std::min(w[j] + k + kAhead, ends[j]), 0, 2);
    }
#pragma GCC unroll 4
    for (int v = 0; v < kLineFloats; v += W) {
      VF xv[kRows];
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) xv[i] = load(x + i * x_stride + k + v);
#pragma GCC unroll 16
      for (int j = 0; j < S; ++j) {
        const VF wv = load(w[j] + k + v);
#pragma GCC unroll 8
        for (int i = 0; i < kRows; ++i) sum[i][j] += wv * xv[i];
      }
    }
  }
  for (int i = 0; i < kRows; ++i) {
    for (int j = 0; j < S; ++j) {
      float s = lane_sum(sum[i][j]);
      for (int64_t k = k_lines; k < K; ++k) s += w[j][k] * x[i * x_stride + k];  // the last K % 16 inputs
      acc[i * S + j] = s;
    }
  }
}

// tile() for rows < kMR rows of x, picked at run time.
template <int S, int kRows>
STAGEWISE_D_INLINE void tile_rows(int rows, const float* const* w, const float* const* ends, const float* x,
                                  int64_t x_stride, int64_t K, bool ahead, float* acc) {
  if constexpr (kRows > 1) {
    if (rows < kRows) return tile_rows<S, kRows - 1>(rows, w, ends, x, x_stride, K, ahead, acc);
  }
  tile<S, kRows>(w, ends, x, x_stride, K, ahead, acc);
}

// Output features n[j], j < S (weight rows w[j]), for every row of x.
template <int S>
STAGEWISE_D_INLINE void features(const Operands& p, const int64_t* n, const float* const* w,
                                 const float* const* ends) {
  for (int64_t t = 0; t < p.rows; t += kMR) {
    const int rows = static_cast<int>(std::min<int64_t>(kMR, p.rows - t));
    float acc[kMR * S];
    // The first pass streams the tile from memory; later ones find it in L2.
    tile_rows<S, kMR>(rows, w, ends, p.x + t * p.x_row_stride, p.x_row_stride, p.in_features, t == 0, acc);
    for (int i = 0; i < rows; ++i) {
      float* out = p.out + (t + i) * p.out_row_stride;
      for (int j = 0; j < S; ++j) out[n[j]] = acc[i * S + j] + (p.bias != nullptr ? p.bias[n[j]] : 0.f);
    }
  }
}

// Output features [n0, n1): kStreams parts of whole tiles, then the rows left over one at a time.
STAGEWISE_D_TARGET void feature_range(const Operands& p, int64_t n0, int64_t n1) {
  const int64_t K = p.in_features, part = (n1 - n0) / kStreams;
  const float* ends[kStreams] = {};  // each part's last float (parts are empty when part is 0)
  for (int j = 0; j < kStreams && part > 0; ++j) ends[j] = p.weight + (n0 + (j + 1) * part) * K - 1;
  for (int64_t t = 0; t < part; ++t) {
    int64_t n[kStreams];
    const float* w[kStreams];
    for (int j = 0; j < kStreams; ++j) {
      n[j] = n0 + j * part + t;
      w[j] = p.weight + n[j] * K;
    }
    features<kStreams>(p, n, w, ends);
  }
  const float* last = p.weight + n1 * K - 1;
  for (int64_t r = n0 + kStreams * part; r < n1; ++r) {
    const float* w = p.weight + r * K;
    features<1>(p, &r, &w, &last);
  }
}

}  // namespace STAGEWISE_D_NS

#undef STAGEWISE_D_INLINE
