// The body of the quant_linear CPU kernel for one ISA, included once per ISA
// by quant_linear.cpp (no include guard, by design) with
//   STAGEWISE_QL_NS      the namespace of this copy,
//   STAGEWISE_QL_ISA     512 (AVX-512), 256 (AVX2 + FMA) or 0 (baseline),
//   STAGEWISE_QL_TARGET  the function attribute selecting that ISA (may be empty).
// Every function carries the target attribute, so the intrinsics of the
// dequantisation inline into the copy that uses them.
#define STAGEWISE_QL_INLINE STAGEWISE_ALWAYS_INLINE STAGEWISE_QL_TARGET

namespace STAGEWISE_QL_NS {

#if STAGEWISE_QL_ISA == 512
constexpr int W = 16, MR = 4, NR = 4;  // 16 accumulators + 8 operands of 32 zmm
#elif STAGEWISE_QL_ISA == 256
constexpr int W = 8, MR = 2, NR = 4;   // 8 accumulators + 6 operands of 16 ymm
#else
constexpr int W = 4, MR = 2, NR = 4;
#endif
using F = Vec<W>::f32;

STAGEWISE_QL_INLINE float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if STAGEWISE_QL_ISA
  return _cvtsh_ss(h);
#else
  return to_float<F16>(h);
#endif
}

// dst[0, 32) = the dequantised weights of one block (include/stagewise/quant.h).
template <QType Q>
STAGEWISE_QL_INLINE void dequantize_block(const uint8_t* __restrict blk, float* __restrict dst) {
  const float d = half_at(blk);
  // Q4_0: d * (q - 8) = d * q - 8 * d exactly (both products exact, the result representable).
  const float offset = Q == QType::kQ4_1 ? half_at(blk + 2) : Q == QType::kQ4_0 ? -8.f * d : 0.f;
#if STAGEWISE_QL_ISA == 512
  const __m512 vd = _mm512_set1_ps(d), vo = _mm512_set1_ps(offset);
  if constexpr (Q == QType::kQ8_0) {
    for (int j = 0; j < kQuantBlock; j += 16) {
      const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + j)));
      _mm512_storeu_ps(dst + j, _mm512_mul_ps(_mm512_cvtepi32_ps(q), vd));
    }
  } else {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (Q == QType::kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(qs, mask), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
    _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vd, vo));
    _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vd, vo));
  }
#elif STAGEWISE_QL_ISA == 256
  const __m256 vd = _mm256_set1_ps(d), vo = _mm256_set1_ps(offset);
  if constexpr (Q == QType::kQ8_0) {
    for (int j = 0; j < kQuantBlock; j += 8) {
      const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + j)));
      _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_cvtepi32_ps(q), vd));
    }
  } else {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (Q == QType::kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i nib[2] = {_mm_and_si128(qs, mask), _mm_and_si128(_mm_srli_epi16(qs, 4), mask)};
    for (int h = 0; h < 2; ++h) {
      const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib[h]));
      const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(nib[h], 8)));
      _mm256_storeu_ps(dst + 16 * h, _mm256_fmadd_ps(a, vd, vo));
      _mm256_storeu_ps(dst + 16 * h + 8, _mm256_fmadd_ps(b, vd, vo));
    }
  }
#else
  if constexpr (Q == QType::kQ8_0) {
    for (int i = 0; i < kQuantBlock; ++i) dst[i] = static_cast<float>(static_cast<int8_t>(blk[2 + i])) * d;
  } else {
    const uint8_t* qs = blk + (Q == QType::kQ4_1 ? 4 : 2);
    for (int i = 0; i < 16; ++i) {
      dst[i] = static_cast<float>(qs[i] & 15) * d + offset;
      dst[i + 16] = static_cast<float>(qs[i] >> 4) * d + offset;
    }
  }
#endif
}

// Rows [begin, end) of W dequantised to float32, row r at out + r * K (the dense path of the glue).
template <QType Q>
STAGEWISE_QL_TARGET void dequantize_rows(const uint8_t* qweight, int64_t K, int64_t begin, int64_t end, float* out) {
  const int64_t nblocks = K / kQuantBlock;
  constexpr int64_t kBytes = quant_block_bytes(Q);
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* row = qweight + r * nblocks * kBytes;
    for (int64_t b = 0; b < nblocks; ++b) dequantize_block<Q>(row + b * kBytes, out + r * K + b * kQuantBlock);
  }
}

// acc[i * NR + j] = dot(x row i, w row j) over k in [0, K), K a multiple of W.
template <int kMR>
STAGEWISE_QL_INLINE void dot_tile(const float* __restrict x, int64_t x_stride, const float* __restrict w,
                                  int64_t K, float* acc) {
  F sum[kMR][NR];
#pragma GCC unroll 16
  for (int i = 0; i < kMR; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) sum[i][j] = F{};
  }
  for (int64_t k = 0; k < K; k += W) {
    F wv[NR], xv[kMR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) wv[j] = load_f32<W>(w + j * K + k);
#pragma GCC unroll 16
    for (int i = 0; i < kMR; ++i) xv[i] = load_f32<W>(x + i * x_stride + k);
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
STAGEWISE_QL_INLINE void dot_tile_rows(int mr, const float* x, int64_t x_stride, const float* w, int64_t K,
                                       float* acc) {
  if constexpr (kMR > 1) {
    if (mr < kMR) return dot_tile_rows<kMR - 1>(mr, x, x_stride, w, K, acc);
  }
  dot_tile<kMR>(x, x_stride, w, K, acc);
}

// Panels [begin, end) of kPanel output features: dequantise, then every row of x against them.
template <QType Q, typename D>
STAGEWISE_QL_TARGET void panels(const QuantLinearParams& p, const Inputs& in, int64_t begin, int64_t end) {
  static_assert(kPanel % NR == 0 && kQuantBlock % W == 0);
  const int64_t K = p.in_features, nblocks = K / kQuantBlock;
  constexpr int64_t kBytes = quant_block_bytes(Q);
  std::vector<float> buf(kPanel * K);
  float* panel = buf.data();
  for (int64_t pi = begin; pi < end; ++pi) {
    const int64_t n_begin = pi * kPanel;
    const int64_t n_count = std::min(kPanel, p.out_features - n_begin);
    for (int64_t r = 0; r < kPanel; ++r) {
      float* dst = panel + r * K;
      if (r < n_count) {
        const uint8_t* row = p.qweight + (n_begin + r) * nblocks * kBytes;
        for (int64_t b = 0; b < nblocks; ++b) dequantize_block<Q>(row + b * kBytes, dst + b * kQuantBlock);
      } else {  // past the last output feature: zeros, computed and never stored
        std::fill(dst, dst + K, 0.f);
      }
    }
    for (int64_t t = 0; t < p.rows; t += MR) {
      const int mr = static_cast<int>(std::min<int64_t>(MR, p.rows - t));
      for (int64_t r = 0; r < n_count; r += NR) {
        float acc[MR * NR];
        dot_tile_rows<MR>(mr, in.x + t * in.x_stride, in.x_stride, panel + r * K, K, acc);
        const int64_t nr = std::min<int64_t>(NR, n_count - r);
        for (int i = 0; i < mr; ++i) {
          Storage<D>* out = static_cast<Storage<D>*>(p.out) + (t + i) * p.out_row_stride + n_begin + r;
          for (int64_t j = 0; j < nr; ++j) {
            const float b = in.bias ? in.bias[n_begin + r + j] : 0.f;
            out[j] = from_float<D>(acc[i * NR + j] + b);
          }
        }
      }
    }
  }
}

}  // namespace STAGEWISE_QL_NS

#undef STAGEWISE_QL_INLINE
