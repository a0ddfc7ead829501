// The tile loops of decode attention over a compact cache (int8 or e4m3 codes, a float16 scale
// per token and kv head; common.h's CacheType), one copy per ISA level: scores of a tile's key
// rows and the p·V accumulation over its value rows, each code widened and converted in
// registers.
//
// The baseline copy is attention_rows.h's generic vector code. The AVX2 and AVX-512 copies are
// written with intrinsics, in functions of their own target: GCC's vector conversion of eight
// bytes goes lane by lane (eight scalar converts), which made the codes slower to read than
// float32; vpmovsxbd / vpmovzxbd widen them in one instruction. These are called (not inlined)
// from the attention loop's copy of the same level.
#pragma once
#include <cstdint>

#include "cpu/attention_rows.h"

#ifdef STAGEWISE_HAVE_AVX2_PATH
#include <immintrin.h>
#endif

namespace stagewise::cpu {

// Every function here works on the G query heads of one kv head at once, so that each code is
// widened once for all of them (a GQA group of 3 reads its keys once, not 3 times):
//   score_codes_*:      s[h * s_stride + i] = scale * k_scales[i] * dot(q[h * D ..], rows[i]),
//   accumulate_codes_*: acc[h * D + d] += sum_{i<n} w[h * w_stride + i] * rows[i][d]
// (w: the softmax weights times the values' scales), for h < G, i < n, d < D.
template <typename C>
STAGEWISE_ALWAYS_INLINE void score_codes_generic(float* s, int64_t s_stride, const float* q, int64_t G,
                                                 const C* const* rows, const float* k_scales, int64_t n,
                                                 int64_t D, float scale) {
  for (int64_t h = 0; h < G; ++h) {
    float* sh = s + h * s_stride;
    score_rows(sh, q + h * D, rows, n, D, scale);
    for (int64_t i = 0; i < n; ++i) sh[i] *= k_scales[i];
  }
}

template <typename C>
STAGEWISE_ALWAYS_INLINE void accumulate_codes_generic(float* acc, const float* w, int64_t w_stride, int64_t G,
                                                      const C* const* rows, int64_t n, int64_t D) {
  for (int64_t h = 0; h < G; ++h) accumulate_rows(acc + h * D, w + h * w_stride, rows, n, D);
}

// The tails the vector loops leave (columns past the last whole vector), and the scales.
template <typename C>
inline void finish_scores(float* s, int64_t s_stride, const float* q, int64_t G, const C* const* rows,
                          const float* k_scales, int64_t n, int64_t D, int64_t done, float scale) {
  for (int64_t h = 0; h < G; ++h) {
    for (int64_t i = 0; i < n; ++i) {
      float& x = s[h * s_stride + i];
      for (int64_t d = done; d < D; ++d) x += q[h * D + d] * static_cast<float>(rows[i][d]);
      x *= scale * k_scales[i];
    }
  }
}

template <typename C>
inline void finish_columns(float* acc, const float* w, int64_t w_stride, int64_t G, const C* const* rows,
                           int64_t n, int64_t D, int64_t done) {
  for (int64_t h = 0; h < G; ++h) {
    for (int64_t d = done; d < D; ++d) {
      float r = acc[h * D + d];
      for (int64_t i = 0; i < n; ++i) r += w[h * w_stride + i] * static_cast<float>(rows[i][d]);
      acc[h * D + d] = r;
    }
  }
}

#ifdef STAGEWISE_HAVE_AVX2_PATH

// ---- AVX2: eight values a register ------------------------------------------------------------

// Eight codes at src as float32.
template <typename C>
STAGEWISE_TARGET_AVX2 inline __m256 codes8_avx2(const C* src) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  if constexpr (std::is_same_v<C, int8_t>) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  } else {  // e4m3 (attention_rows.h's load8 says how)
    const __m256i w = _mm256_cvtepu8_epi32(bytes);
    const __m256i magnitude = _mm256_and_si256(w, _mm256_set1_epi32(0x7F));
    const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(120 << 23));
    const __m256 subnormal = _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_and_si256(magnitude, _mm256_set1_epi32(7))), _mm256_set1_ps(0x1.0p-9f));
    const __m256i is_subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude);
    const __m256 value = _mm256_blendv_ps(_mm256_castsi256_ps(normal), subnormal, _mm256_castsi256_ps(is_subnormal));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x80)), 24);
    return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
  }
}

STAGEWISE_TARGET_AVX2 inline float sum8_avx2(__m256 v) {
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_shuffle_ps(y, y, 1)));
}

// The four lane sums of a, b, c, d into out[0..4).
STAGEWISE_TARGET_AVX2 inline void sum4x8_avx2(__m256 a, __m256 b, __m256 c, __m256 d, float* out) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// HN heads (1..4) of one head group over the rows two at a time: 2 * HN accumulators.
template <typename C, int HN>
STAGEWISE_TARGET_AVX2 void score_heads_avx2(float* s, int64_t s_stride, const float* q, const C* const* rows,
                                            int64_t n, int64_t D8, int64_t D) {
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    __m256 a[HN][2];
    for (int h = 0; h < HN; ++h) a[h][0] = a[h][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
      const __m256 k0 = codes8_avx2(rows[i] + d), k1 = codes8_avx2(rows[i + 1] + d);
      for (int h = 0; h < HN; ++h) {
        const __m256 qv = _mm256_loadu_ps(q + h * D + d);
        a[h][0] = _mm256_fmadd_ps(qv, k0, a[h][0]);
        a[h][1] = _mm256_fmadd_ps(qv, k1, a[h][1]);
      }
    }
    for (int h = 0; h < HN; h += 2) {  // four sums at a time: rows i, i + 1 of heads h, h + 1
      float sums[4];
      const __m256 z = _mm256_setzero_ps();
      sum4x8_avx2(a[h][0], a[h][1], h + 1 < HN ? a[h + 1][0] : z, h + 1 < HN ? a[h + 1][1] : z, sums);
      s[h * s_stride + i] = sums[0];
      s[h * s_stride + i + 1] = sums[1];
      if (h + 1 < HN) {
        s[(h + 1) * s_stride + i] = sums[2];
        s[(h + 1) * s_stride + i + 1] = sums[3];
      }
    }
  }
  for (; i < n; ++i) {
    for (int h = 0; h < HN; ++h) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < D8; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), codes8_avx2(rows[i] + d), a);
      s[h * s_stride + i] = sum8_avx2(a);
    }
  }
}

template <typename C>
STAGEWISE_TARGET_AVX2 void score_codes_avx2(float* s, int64_t s_stride, const float* q, int64_t G,
                                            const C* const* rows, const float* k_scales, int64_t n, int64_t D,
                                            float scale) {
  const int64_t D8 = D / 8 * 8;
  for (int64_t h = 0; h < G; h += 4) {
    float* sh = s + h * s_stride;
    const float* qh = q + h * D;
    switch (std::min<int64_t>(4, G - h)) {
      case 1: score_heads_avx2<C, 1>(sh, s_stride, qh, rows, n, D8, D); break;
      case 2: score_heads_avx2<C, 2>(sh, s_stride, qh, rows, n, D8, D); break;
      case 3: score_heads_avx2<C, 3>(sh, s_stride, qh, rows, n, D8, D); break;
      default: score_heads_avx2<C, 4>(sh, s_stride, qh, rows, n, D8, D); break;
    }
  }
  finish_scores(s, s_stride, q, G, rows, k_scales, n, D, D8, scale);
}

// HN heads' 16 columns from d0, in 2 * HN registers across the rows.
template <typename C, int HN>
STAGEWISE_TARGET_AVX2 void accumulate_heads_avx2(float* acc, const float* w, int64_t w_stride, const C* const* rows,
                                                 int64_t n, int64_t D, int64_t d0) {
  __m256 r[HN][2];
  for (int h = 0; h < HN; ++h) {
    r[h][0] = _mm256_loadu_ps(acc + h * D + d0);
    r[h][1] = _mm256_loadu_ps(acc + h * D + d0 + 8);
  }
  for (int64_t i = 0; i < n; ++i) {
    const __m256 x0 = codes8_avx2(rows[i] + d0), x1 = codes8_avx2(rows[i] + d0 + 8);
    for (int h = 0; h < HN; ++h) {
      const __m256 wi = _mm256_set1_ps(w[h * w_stride + i]);
      r[h][0] = _mm256_fmadd_ps(wi, x0, r[h][0]);
      r[h][1] = _mm256_fmadd_ps(wi, x1, r[h][1]);
    }
  }
  for (int h = 0; h < HN; ++h) {
    _mm256_storeu_ps(acc + h * D + d0, r[h][0]);
    _mm256_storeu_ps(acc + h * D + d0 + 8, r[h][1]);
  }
}

template <typename C>
STAGEWISE_TARGET_AVX2 void accumulate_codes_avx2(float* acc, const float* w, int64_t w_stride, int64_t G,
                                                 const C* const* rows, int64_t n, int64_t D) {
  const int64_t D16 = D / 16 * 16;
  for (int64_t h = 0; h < G; h += 4) {
    for (int64_t d0 = 0; d0 < D16; d0 += 16) {
      float* ah = acc + h * D;
      const float* wh = w + h * w_stride;
      switch (std::min<int64_t>(4, G - h)) {
        case 1: accumulate_heads_avx2<C, 1>(ah, wh, w_stride, rows, n, D, d0); break;
        case 2: accumulate_heads_avx2<C, 2>(ah, wh, w_stride, rows, n, D, d0); break;
        case 3: accumulate_heads_avx2<C, 3>(ah, wh, w_stride, rows, n, D, d0); break;
        default: accumulate_heads_avx2<C, 4>(ah, wh, w_stride, rows, n, D, d0); break;
      }
    }
  }
  finish_columns(acc, w, w_stride, G, rows, n, D, D16);
}

// ---- AVX-512: sixteen values a register ---------------------------------------------------------

template <typename C>
STAGEWISE_TARGET_AVX512 inline __m512 codes16_avx512(const C* src) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  if constexpr (std::is_same_v<C, int8_t>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  } else {
    const __m512i w = _mm512_cvtepu8_epi32(bytes);
    const __m512i magnitude = _mm512_and_si512(w, _mm512_set1_epi32(0x7F));
    const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23));
    const __m512 subnormal = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_and_si512(magnitude, _mm512_set1_epi32(7))), _mm512_set1_ps(0x1.0p-9f));
    const __mmask16 is_subnormal = _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(8));
    const __m512 value = _mm512_mask_blend_ps(is_subnormal, _mm512_castsi512_ps(normal), subnormal);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
  }
}

STAGEWISE_TARGET_AVX512 inline __m256 halves_avx512(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

template <typename C, int HN>
STAGEWISE_TARGET_AVX512 void score_heads_avx512(float* s, int64_t s_stride, const float* q, const C* const* rows,
                                                int64_t n, int64_t D16, int64_t D) {
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    __m512 a[HN][2];
    for (int h = 0; h < HN; ++h) a[h][0] = a[h][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D16; d += 16) {
      const __m512 k0 = codes16_avx512(rows[i] + d), k1 = codes16_avx512(rows[i + 1] + d);
      for (int h = 0; h < HN; ++h) {
        const __m512 qv = _mm512_loadu_ps(q + h * D + d);
        a[h][0] = _mm512_fmadd_ps(qv, k0, a[h][0]);
        a[h][1] = _mm512_fmadd_ps(qv, k1, a[h][1]);
      }
    }
    for (int h = 0; h < HN; h += 2) {
      float sums[4];
      const __m256 z = _mm256_setzero_ps();
      sum4x8_avx2(halves_avx512(a[h][0]), halves_avx512(a[h][1]), h + 1 < HN ? halves_avx512(a[h + 1][0]) : z,
                  h + 1 < HN ? halves_avx512(a[h + 1][1]) : z, sums);
      s[h * s_stride + i] = sums[0];
      s[h * s_stride + i + 1] = sums[1];
      if (h + 1 < HN) {
        s[(h + 1) * s_stride + i] = sums[2];
        s[(h + 1) * s_stride + i + 1] = sums[3];
      }
    }
  }
  for (; i < n; ++i) {
    for (int h = 0; h < HN; ++h) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t d = 0; d < D16; d += 16) {
        a = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + d), codes16_avx512(rows[i] + d), a);
      }
      s[h * s_stride + i] = _mm512_reduce_add_ps(a);
    }
  }
}

template <typename C>
STAGEWISE_TARGET_AVX512 void score_codes_avx512(float* s, int64_t s_stride, const float* q, int64_t G,
                                                const C* const* rows, const float* k_scales, int64_t n, int64_t D,
                                                float scale) {
  const int64_t D16 = D / 16 * 16;
  for (int64_t h = 0; h < G; h += 4) {
    float* sh = s + h * s_stride;
    const float* qh = q + h * D;
    switch (std::min<int64_t>(4, G - h)) {
      case 1: score_heads_avx512<C, 1>(sh, s_stride, qh, rows, n, D16, D); break;
      case 2: score_heads_avx512<C, 2>(sh, s_stride, qh, rows, n, D16, D); break;
      case 3: score_heads_avx512<C, 3>(sh, s_stride, qh, rows, n, D16, D); break;
      default: score_heads_avx512<C, 4>(sh, s_stride, qh, rows, n, D16, D); break;
    }
  }
  finish_scores(s, s_stride, q, G, rows, k_scales, n, D, D16, scale);
}

// HN heads' 32 columns from d0, in 2 * HN registers across the rows.
template <typename C, int HN>
STAGEWISE_TARGET_AVX512 void accumulate_heads_avx512(float* acc, const float* w, int64_t w_stride,
                                                     const C* const* rows, int64_t n, int64_t D, int64_t d0) {
  __m512 r[HN][2];
  for (int h = 0; h < HN; ++h) {
    r[h][0] = _mm512_loadu_ps(acc + h * D + d0);
    r[h][1] = _mm512_loadu_ps(acc + h * D + d0 + 16);
  }
  for (int64_t i = 0; i < n; ++i) {
    const __m512 x0 = codes16_avx512(rows[i] + d0), x1 = codes16_avx512(rows[i] + d0 + 16);
    for (int h = 0; h < HN; ++h) {
      const __m512 wi = _mm512_set1_ps(w[h * w_stride + i]);
      r[h][0] = _mm512_fmadd_ps(wi, x0, r[h][0]);
      r[h][1] = _mm512_fmadd_ps(wi, x1, r[h][1]);
    }
  }
  for (int h = 0; h < HN; ++h) {
    _mm512_storeu_ps(acc + h * D + d0, r[h][0]);
    _mm512_storeu_ps(acc + h * D + d0 + 16, r[h][1]);
  }
}

template <typename C>
STAGEWISE_TARGET_AVX512 void accumulate_codes_avx512(float* acc, const float* w, int64_t w_stride, int64_t G,
                                                     const C* const* rows, int64_t n, int64_t D) {
  const int64_t D32 = D / 32 * 32;
  for (int64_t h = 0; h < G; h += 4) {
    for (int64_t d0 = 0; d0 < D32; d0 += 32) {
      float* ah = acc + h * D;
      const float* wh = w + h * w_stride;
      switch (std::min<int64_t>(4, G - h)) {
        case 1: accumulate_heads_avx512<C, 1>(ah, wh, w_stride, rows, n, D, d0); break;
        case 2: accumulate_heads_avx512<C, 2>(ah, wh, w_stride, rows, n, D, d0); break;
        case 3: accumulate_heads_avx512<C, 3>(ah, wh, w_stride, rows, n, D, d0); break;
        default: accumulate_heads_avx512<C, 4>(ah, wh, w_stride, rows, n, D, d0); break;
      }
    }
  }
  finish_columns(acc, w, w_stride, G, rows, n, D, D32);
}

#endif  // STAGEWISE_HAVE_AVX2_PATH

}  // namespace stagewise::cpu
