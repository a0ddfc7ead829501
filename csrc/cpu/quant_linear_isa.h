// The exact-mode kernels of quant_linear for one ISA level, included once per level by
// quant_linear.cpp inside the level's namespace (no include guard, by design) with
//   STAGEWISE_Q_LEVEL   0 (baseline), 1 (AVX2), 2 (AVX-512): the Isa of cpu/isa.h;
//   STAGEWISE_Q_TARGET  the function attribute of that level (empty for the baseline).
//
// Two kernels, both over the exact float32 weights (quant_blocks.h):
//   direct (AVX2 and AVX-512): each 32-weight sub-block of kNR weight rows is decoded into
//     registers and multiplied straight into kMR x kNR float32 partial-sum vectors; nothing is
//     stored, the weights are read once per pass over the rows of x.
//   panels (the baseline): kPanel weight rows are dequantised once into float32 scratch (L1/L2
//     resident), then a register-blocked micro-kernel (MR rows of x by NR rows of the panel)
//     runs every row of x against it.
#define STAGEWISE_Q_INLINE STAGEWISE_ALWAYS_INLINE STAGEWISE_Q_TARGET

namespace STAGEWISE_Q_NS {

#if STAGEWISE_Q_LEVEL >= 1
#include "cpu/quant_decode_isa.h"
#endif

#if STAGEWISE_Q_LEVEL >= 2
constexpr int W = 16, MR = 4, NR = 4;  // panel tile: 16 accumulators + 8 operands of 32 zmm
constexpr int kDirectMR = 4, kDirectNR = 4;
#elif STAGEWISE_Q_LEVEL == 1
constexpr int W = 8, MR = 2, NR = 4;   // 8 accumulators + 6 operands of 16 ymm
constexpr int kDirectMR = 2, kDirectNR = 4;
#else
constexpr int W = 4, MR = 2, NR = 4;
#endif
typedef float F __attribute__((vector_size(4 * W)));  // the panel kernel's vectors

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

#if STAGEWISE_Q_LEVEL == 0
template <QType Q>
void dequantize_rows(const uint8_t* qweight, int64_t K, int64_t begin, int64_t end, float* out) {
  const int64_t nblocks = K / Block<Q>::kWeights;
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* row = qweight + r * nblocks * Block<Q>::kBytes;
    for (int64_t b = 0; b < nblocks; ++b) {
      for (int sub = 0; sub < Block<Q>::kSubs; ++sub) {
        dequantize_sub_scalar<Q>(row + b * Block<Q>::kBytes, sub, out + r * K + (b * Block<Q>::kSubs + sub) * 32);
      }
    }
  }
}
#endif

// Stores acc[i * nr_max + j] (+ bias) as outputs [n0, n0 + nr) of rows [t, t + mr).
template <typename D>
STAGEWISE_Q_INLINE void store_tile(const QuantLinearParams& p, const float* bias, const float* acc, int64_t t, int mr,
                                   int64_t n0, int64_t nr, int nr_max) {
  for (int i = 0; i < mr; ++i) {
    Storage<D>* out = static_cast<Storage<D>*>(p.out) + (t + i) * p.out_row_stride + n0;
    for (int64_t j = 0; j < nr; ++j) out[j] = from_float<D>(acc[i * nr_max + j] + (bias ? bias[n0 + j] : 0.f));
  }
}

// ---- panels ---------------------------------------------------------------------------------

// acc[i * NR + j] = dot(x row i, w row j) over k in [0, K), K a multiple of W.
template <int kMR>
STAGEWISE_Q_INLINE void dot_tile(const float* __restrict x, int64_t x_stride, const float* __restrict w, int64_t K,
                                 float* acc) {
  F sum[kMR][NR];
#pragma GCC unroll 16
  for (int i = 0; i < kMR; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) sum[i][j] = F{};
  }
  for (int64_t k = 0; k < K; k += W) {
    F wv[NR], xv[kMR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) wv[j] = load_f32(w + j * K + k);
#pragma GCC unroll 16
    for (int i = 0; i < kMR; ++i) xv[i] = load_f32(x + i * x_stride + k);
#pragma GCC unroll 16
    for (int i = 0; i < kMR; ++i) {
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) sum[i][j] += xv[i] * wv[j];
    }
  }
  for (int i = 0; i < kMR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = 0.f;
      for (int l = 0; l < W; ++l) s += sum[i][j][l];
      acc[i * NR + j] = s;
    }
  }
}

// dot_tile for mr <= MR rows of x, mr picked at run time.
template <int kMR>
STAGEWISE_Q_INLINE void dot_tile_rows(int mr, const float* x, int64_t x_stride, const float* w, int64_t K, float* acc) {
  if constexpr (kMR > 1) {
    if (mr < kMR) return dot_tile_rows<kMR - 1>(mr, x, x_stride, w, K, acc);
  }
  dot_tile<kMR>(x, x_stride, w, K, acc);
}

// Panels [begin, end) of kPanel output features: dequantise, then every row of x against them.
template <QType Q, typename D>
STAGEWISE_Q_TARGET void panels(const QuantLinearParams& p, const Inputs& in, int64_t begin, int64_t end) {
  static_assert(kPanel % NR == 0 && kQuantBlock % W == 0);
  const int64_t K = p.in_features, nblocks = K / Block<Q>::kWeights;
  std::vector<float> buf(kPanel * K);
  float* panel = buf.data();
  for (int64_t pi = begin; pi < end; ++pi) {
    const int64_t n_begin = pi * kPanel;
    const int64_t n_count = std::min(kPanel, p.out_features - n_begin);
    for (int64_t r = 0; r < kPanel; ++r) {
      float* dst = panel + r * K;
      if (r < n_count) {
        const uint8_t* row = p.qweight + (n_begin + r) * nblocks * Block<Q>::kBytes;
        for (int64_t b = 0; b < nblocks; ++b) dequantize_block<Q>(row + b * Block<Q>::kBytes, dst + b * Block<Q>::kWeights);
      } else {  // past the last output feature: zeros, computed and never stored
        std::fill(dst, dst + K, 0.f);
      }
    }
    for (int64_t t = 0; t < p.rows; t += MR) {
      const int mr = static_cast<int>(std::min<int64_t>(MR, p.rows - t));
      for (int64_t r = 0; r < n_count; r += NR) {
        float acc[MR * NR];
        dot_tile_rows<MR>(mr, in.x + t * in.x_stride, in.x_stride, panel + r * K, K, acc);
        store_tile<D>(p, in.bias, acc, t, mr, n_begin + r, std::min<int64_t>(NR, n_count - r), NR);
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
