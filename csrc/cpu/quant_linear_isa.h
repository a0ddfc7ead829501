// The exact-mode kernels of quant_linear for one ISA level, included once per level by
// quant_linear.cpp inside the level's namespace (no include guard, by design) with
//   STAGEWISE_Q_LEVEL   0 (baseline), 1 (AVX2), 2 (AVX-512): the Isa of cpu/isa.h;
//   STAGEWISE_Q_TARGET  the function attribute of that level (empty for the baseline).
//
// Two kernels, both over the exact float32 weights (quant_blocks.h):
//   direct (AVX2 and AVX-512; a few rows of x): each 32-weight sub-block of kNR weight rows is
//     decoded into registers and multiplied straight into kMR x kNR float32 partial-sum vectors;
//     nothing is stored, the weights are read once per pass over the rows of x.
//   tiles (every level; more rows, a prompt): kTileNF weight rows are dequantised once per block
//     of rows into a float32 panel (L1/L2 resident), then every group of rows of x, packed
//     transposed (pack_group: for each k the rows side by side), runs against it: per k a vector
//     of rows times each weight broadcast, into 2 x kTileNF partial-sum vectors.
#define STAGEWISE_Q_INLINE STAGEWISE_ALWAYS_INLINE STAGEWISE_Q_TARGET

namespace STAGEWISE_Q_NS {

#if STAGEWISE_Q_LEVEL >= 1
#include "cpu/quant_decode_isa.h"
#endif

// W: floats a vector of the tile kernel; kTileNF: the weight rows of its tile (kRV * kTileNF
// partial sums of kRV vectors of rows, plus kRV operands, within the level's registers).
#if STAGEWISE_Q_LEVEL >= 2
constexpr int W = 16, kTileNF = 12;  // 24 + 2 of 32 zmm (the broadcasts fold into the FMAs)
constexpr int kDirectMR = 4, kDirectNR = 4;
#elif STAGEWISE_Q_LEVEL == 1
constexpr int W = 8, kTileNF = 6;    // 12 + 2 + a broadcast of 16 ymm
constexpr int kDirectMR = 2, kDirectNR = 4;
#else
constexpr int W = 4, kTileNF = 6;
#endif
constexpr int64_t kGroupRows = 2 * W;  // rows of x a group of pack_group holds
typedef float F __attribute__((vector_size(4 * W)));  // the tile kernel's vectors

STAGEWISE_Q_INLINE F load_f32(const float* p) {
  F v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// dst[0, block weights) = the exact weights of the block at blk.
template <QType Q>
STAGEWISE_Q_INLINE void dequantize_block(const uint8_t* blk, float* dst) {
#if STAGEWISE_Q_LEVEL >= 1
  Factors<Q> f;
  block_factors<Q>(blk, f);
  for (int sub = 0; sub < Block<Q>::kSubs; ++sub) {
    VF w[kSubVectors];
    sub_weights<Q>(blk, sub, f, w);
    for (int v = 0; v < kSubVectors; ++v) vstore(dst + sub * kQuantBlock + v * kVecLanes, w[v]);
  }
#else
  for (int sub = 0; sub < Block<Q>::kSubs; ++sub) dequantize_sub_scalar<Q>(blk, sub, dst + sub * kQuantBlock);
#endif
}

// Stores acc[i * nr_max + j] (+ bias) as outputs [n0, n0 + nr) of rows [t, t + mr).
template <typename D>
STAGEWISE_Q_INLINE void store_tile(const QuantLinearParams& p, const float* bias, const float* acc, int64_t t, int mr,
                                   int64_t n0, int64_t nr, int nr_max) {
  for (int i = 0; i < mr; ++i) {
    Storage<D>* out = static_cast<Storage<D>*>(p.out) + (t + i) * p.out_row_stride + n0;
    for (int64_t j = 0; j < nr; ++j) out[j] = from_float<D>(acc[i * nr_max + j] + (bias ? bias[n0 + j] : 0.f));
  }
}

// ---- tiles ------------------------------------------------------------------------------------

#if STAGEWISE_Q_LEVEL >= 1
// r[i] = lane i of r[0..7] (an 8 x 8 transpose).
STAGEWISE_Q_INLINE void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {
    u[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}
#endif

// One group of the tile kernel's x: rows [0, n) of x (row stride x_stride, n <= kGroupRows) as
// dst [K][kGroupRows], for every k the rows side by side, rows from n on zeros. 8 x 8 blocks
// transposed in registers where there are vectors (K is a multiple of 32).
STAGEWISE_Q_TARGET void pack_group(const float* x, int64_t x_stride, int64_t n, int64_t K, float* dst) {
#if STAGEWISE_Q_LEVEL >= 1
  for (int64_t r0 = 0; r0 < kGroupRows; r0 += 8) {
    for (int64_t k = 0; k < K; k += 8) {
      __m256 r[8];
      for (int64_t i = 0; i < 8; ++i) {
        r[i] = r0 + i < n ? _mm256_loadu_ps(x + (r0 + i) * x_stride + k) : _mm256_setzero_ps();
      }
      transpose8(r);
      for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(dst + (k + i) * kGroupRows + r0, r[i]);
    }
  }
#else
  for (int64_t r = 0; r < kGroupRows; ++r) {
    for (int64_t k = 0; k < K; ++k) dst[k * kGroupRows + r] = r < n ? x[r * x_stride + k] : 0.f;
  }
#endif
}

// acc[j * kGroupRows + r] = dot(x row r, W row j) for the kTileNF weight rows of `panel` and the
// kRV * W rows of x in `xt` (pack_group; rows past the last are zeros). Per k one vector
// of x rows a kRV and each weight broadcast against them: kRV * kTileNF partial sums, no
// horizontal sums.
template <int kRV>
STAGEWISE_Q_TARGET void tile_rows(const float* __restrict xt, const float* __restrict panel, int64_t K, float* acc) {
  F sum[kRV][kTileNF];
#pragma GCC unroll 16
  for (int v = 0; v < kRV; ++v) {
#pragma GCC unroll 16
    for (int j = 0; j < kTileNF; ++j) sum[v][j] = F{};
  }
  for (int64_t k0 = 0; k0 < K; k0 += kTileKC) {
    const int64_t kc = std::min<int64_t>(kTileKC, K - k0);
    const float* __restrict w = panel + k0 * kTileNF;
    const float* __restrict xk = xt + k0 * kGroupRows;
    for (int64_t k = 0; k < kc; ++k, xk += kGroupRows) {
      F xv[kRV];
#pragma GCC unroll 4
      for (int v = 0; v < kRV; ++v) xv[v] = load_f32(xk + v * W);
#pragma GCC unroll 16
      for (int j = 0; j < kTileNF; ++j) {
        const float b = w[j * kTileKC + k];
#pragma GCC unroll 4
        for (int v = 0; v < kRV; ++v) sum[v][j] += xv[v] * b;
      }
    }
  }
  for (int j = 0; j < kTileNF; ++j) {
    for (int v = 0; v < kRV; ++v) std::memcpy(acc + j * kGroupRows + v * W, &sum[v][j], sizeof(F));
  }
}

// Tiles [begin, end) of kTileNF output features: their weights dequantised into a panel (chunks of
// kTileKC k, [kTileNF][kTileKC] each: the loads of one k sit at fixed offsets), which stays in
// L1/L2 while every group of rows [in.row_begin, in.row_end) of x (in.xt, pack_group) runs over it.
template <QType Q, typename D>
STAGEWISE_Q_TARGET void tiles(const QuantLinearParams& p, const Inputs& in, int64_t begin, int64_t end) {
  static_assert(kTileKC % Block<Q>::kWeights == 0);
  const int64_t K = p.in_features, nblocks = K / Block<Q>::kWeights;
  const int64_t row_bytes = nblocks * Block<Q>::kBytes;
  const std::unique_ptr<float[]> buf(new float[(K + kTileKC - 1) / kTileKC * kTileNF * kTileKC]);
  float* panel = buf.get();
  alignas(64) float acc[kTileNF * kGroupRows];
  for (int64_t tile = begin; tile < end; ++tile) {
    const int64_t n0 = tile * kTileNF, nf = std::min<int64_t>(kTileNF, p.out_features - n0);
    for (int64_t j = 0; j < kTileNF; ++j) {
      for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t k = b * Block<Q>::kWeights;
        float* dst = panel + (k / kTileKC) * kTileNF * kTileKC + j * kTileKC + k % kTileKC;
        if (j < nf) {
          dequantize_block<Q>(p.qweight + (n0 + j) * row_bytes + b * Block<Q>::kBytes, dst);
        } else {  // past the last output feature: zeros, computed and never stored
          std::fill(dst, dst + Block<Q>::kWeights, 0.f);
        }
      }
    }
    for (int64_t t = in.row_begin; t < in.row_end; t += kGroupRows) {
      const int64_t mr = std::min<int64_t>(kGroupRows, in.row_end - t);
      const float* xt = in.xt + (t - in.row_begin) * K;
      if (mr > W) {
        tile_rows<2>(xt, panel, K, acc);
      } else {
        tile_rows<1>(xt, panel, K, acc);
      }
      for (int64_t r = 0; r < mr; ++r) {
        Storage<D>* out = static_cast<Storage<D>*>(p.out) + (t + r) * p.out_row_stride + n0;
        for (int64_t j = 0; j < nf; ++j) {
          out[j] = from_float<D>(acc[j * kGroupRows + r] + (in.bias ? in.bias[n0 + j] : 0.f));
        }
      }
    }
  }
}

// ---- direct -----------------------------------------------------------------------------------

#if STAGEWISE_Q_LEVEL >= 1
// acc[i * kDirectNR + j] = dot(x row i, W row j) for the kDirectNR weight rows at rows[j].
template <QType Q, int kMR>
STAGEWISE_Q_TARGET void direct_tile(const uint8_t* const* rows, const float* x, int64_t x_stride, int64_t K,
                                    float* acc, StreamPrefetch* pf, int64_t step_bytes) {
  VF sum[kMR][kDirectNR];
#pragma GCC unroll 16
  for (int i = 0; i < kMR; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kDirectNR; ++j) sum[i][j] = vzero();
  }
  const int64_t nblocks = K / Block<Q>::kWeights;
  for (int64_t b = 0; b < nblocks; ++b) {
    Factors<Q> f[kDirectNR];
#pragma GCC unroll 8
    for (int j = 0; j < kDirectNR; ++j) block_factors<Q>(rows[j] + b * Block<Q>::kBytes, f[j]);
    for (int sub = 0; sub < Block<Q>::kSubs; ++sub) {
      const int64_t xb = b * Block<Q>::kSubs + sub;
      if (pf != nullptr) pf->reach(rows[0] + (xb + 1) * step_bytes);
      const float* xk = x + xb * kQuantBlock;
#pragma GCC unroll 8
      for (int j = 0; j < kDirectNR; ++j) {
        VF w[kSubVectors];
        sub_weights<Q>(rows[j] + b * Block<Q>::kBytes, sub, f[j], w);
#pragma GCC unroll 8
        for (int i = 0; i < kMR; ++i) {
#pragma GCC unroll 4
          for (int v = 0; v < kSubVectors; ++v) sum[i][j] = vfma(w[v], vload(xk + i * x_stride + v * kVecLanes), sum[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < kMR; ++i) {
    for (int j = 0; j < kDirectNR; ++j) acc[i * kDirectNR + j] = vsum(sum[i][j]);
  }
}

template <QType Q, int kMR>
STAGEWISE_Q_INLINE void direct_tile_rows(int mr, const uint8_t* const* rows, const float* x, int64_t x_stride,
                                         int64_t K, float* acc, StreamPrefetch* pf, int64_t step_bytes) {
  if constexpr (kMR > 1) {
    if (mr < kMR) return direct_tile_rows<Q, kMR - 1>(mr, rows, x, x_stride, K, acc, pf, step_bytes);
  }
  direct_tile<Q, kMR>(rows, x, x_stride, K, acc, pf, step_bytes);
}

// Tiles [begin, end) of kDirectNR output features against every row of x.
template <QType Q, typename D>
STAGEWISE_Q_TARGET void direct(const QuantLinearParams& p, const Inputs& in, int64_t begin, int64_t end) {
  const int64_t row_bytes = p.in_features / Block<Q>::kWeights * Block<Q>::kBytes;
  const int64_t subs = p.in_features / kQuantBlock;
  const int64_t step_bytes = (kDirectNR * row_bytes + subs - 1) / subs;  // a tile's bytes a sub-block
  StreamPrefetch ahead(p.qweight + begin * kDirectNR * row_bytes,
                       p.qweight + std::min(end * kDirectNR, p.out_features) * row_bytes);
  for (int64_t tile = begin; tile < end; ++tile) {
    const int64_t n0 = tile * kDirectNR, nr = std::min<int64_t>(kDirectNR, p.out_features - n0);
    const uint8_t* rows[kDirectNR];
    for (int j = 0; j < kDirectNR; ++j) rows[j] = p.qweight + (n0 + std::min<int64_t>(j, nr - 1)) * row_bytes;
    for (int64_t t = 0; t < p.rows; t += kDirectMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kDirectMR, p.rows - t));
      float acc[kDirectMR * kDirectNR];
      direct_tile_rows<Q, kDirectMR>(mr, rows, in.x + t * in.x_stride, in.x_stride, p.in_features, acc,
                                     t == 0 ? &ahead : nullptr, step_bytes);
      store_tile<D>(p, in.bias, acc, t, mr, n0, nr, kDirectNR);
    }
  }
}
#endif

}  // namespace STAGEWISE_Q_NS

#undef STAGEWISE_Q_INLINE
