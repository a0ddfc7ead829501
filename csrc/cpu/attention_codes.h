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

// s[i] = scale * k_scales[i] * dot(q, rows[i][0..D)) for i < n.
template <typename C>
STAGEWISE_ALWAYS_INLINE void score_codes_generic(float* s, const float* q, const C* const* rows,
                                                 const float* k_scales, int64_t n, int64_t D,
                                                 float scale) {
  score_rows(s, q, rows, n, D, scale);
  for (int64_t i = 0; i < n; ++i) s[i] *= k_scales[i];
}

// acc[0..D) += sum_{i<n} w[i] * rows[i][0..D) (w: softmax weights times the values' scales).
template <typename C>
STAGEWISE_ALWAYS_INLINE void accumulate_codes_generic(float* acc, const float* w, const C* const* rows,
                                                      int64_t n, int64_t D) {
  accumulate_rows(acc, w, rows, n, D);
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

template <typename C>
STAGEWISE_TARGET_AVX2 void score_codes_avx2(float* s, const float* q, const C* const* rows,
                                            const float* k_scales, int64_t n, int64_t D, float scale) {
  const int64_t D8 = D / 8 * 8;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {  // four rows: four independent FMA chains, q loaded once for them
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D8; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      a0 = _mm256_fmadd_ps(qv, codes8_avx2(rows[i] + d), a0);
      a1 = _mm256_fmadd_ps(qv, codes8_avx2(rows[i + 1] + d), a1);
      a2 = _mm256_fmadd_ps(qv, codes8_avx2(rows[i + 2] + d), a2);
      a3 = _mm256_fmadd_ps(qv, codes8_avx2(rows[i + 3] + d), a3);
    }
    sum4x8_avx2(a0, a1, a2, a3, s + i);
  }
  for (; i < n; ++i) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), codes8_avx2(rows[i] + d), a);
    s[i] = sum8_avx2(a);
  }
  for (i = 0; i < n; ++i) {
    for (int64_t d = D8; d < D; ++d) s[i] += q[d] * static_cast<float>(rows[i][d]);
    s[i] *= scale * k_scales[i];
  }
}

template <typename C>
STAGEWISE_TARGET_AVX2 void accumulate_codes_avx2(float* acc, const float* w, const C* const* rows, int64_t n,
                                                 int64_t D) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {  // 64 columns held in eight registers across the rows
    __m256 r[8];
    for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(acc + d + 8 * j);
    for (int64_t i = 0; i < n; ++i) {
      const __m256 wi = _mm256_set1_ps(w[i]);
      for (int j = 0; j < 8; ++j) r[j] = _mm256_fmadd_ps(wi, codes8_avx2(rows[i] + d + 8 * j), r[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc + d + 8 * j, r[j]);
  }
  for (; d + 8 <= D; d += 8) {
    __m256 r = _mm256_loadu_ps(acc + d);
    for (int64_t i = 0; i < n; ++i) r = _mm256_fmadd_ps(_mm256_set1_ps(w[i]), codes8_avx2(rows[i] + d), r);
    _mm256_storeu_ps(acc + d, r);
  }
  for (; d < D; ++d) {
    float r = acc[d];
    for (int64_t i = 0; i < n; ++i) r += w[i] * static_cast<float>(rows[i][d]);
    acc[d] = r;
  }
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

template <typename C>
STAGEWISE_TARGET_AVX512 void score_codes_avx512(float* s, const float* q, const C* const* rows,
                                                const float* k_scales, int64_t n, int64_t D, float scale) {
  const int64_t D16 = D / 16 * 16;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D16; d += 16) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      a0 = _mm512_fmadd_ps(qv, codes16_avx512(rows[i] + d), a0);
      a1 = _mm512_fmadd_ps(qv, codes16_avx512(rows[i + 1] + d), a1);
      a2 = _mm512_fmadd_ps(qv, codes16_avx512(rows[i + 2] + d), a2);
      a3 = _mm512_fmadd_ps(qv, codes16_avx512(rows[i + 3] + d), a3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(halves_avx512(a0), halves_avx512(a1)),
                                    _mm256_hadd_ps(halves_avx512(a2), halves_avx512(a3)));
    _mm_storeu_ps(s + i, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
  for (; i < n; ++i) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D16; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), codes16_avx512(rows[i] + d), a);
    s[i] = _mm512_reduce_add_ps(a);
  }
  for (i = 0; i < n; ++i) {
    for (int64_t d = D16; d < D; ++d) s[i] += q[d] * static_cast<float>(rows[i][d]);
    s[i] *= scale * k_scales[i];
  }
}

template <typename C>
STAGEWISE_TARGET_AVX512 void accumulate_codes_avx512(float* acc, const float* w, const C* const* rows,
                                                     int64_t n, int64_t D) {
  int64_t d = 0;
  for (; d + 128 <= D; d += 128) {  // 128 columns held in eight registers across the rows
    __m512 r[8];
    for (int j = 0; j < 8; ++j) r[j] = _mm512_loadu_ps(acc + d + 16 * j);
    for (int64_t i = 0; i < n; ++i) {
      const __m512 wi = _mm512_set1_ps(w[i]);
      for (int j = 0; j < 8; ++j) r[j] = _mm512_fmadd_ps(wi, codes16_avx512(rows[i] + d + 16 * j), r[j]);
    }
    for (int j = 0; j < 8; ++j) _mm512_storeu_ps(acc + d + 16 * j, r[j]);
  }
  for (; d + 64 <= D; d += 64) {
    __m512 r[4];
    for (int j = 0; j < 4; ++j) r[j] = _mm512_loadu_ps(acc + d + 16 * j);
    for (int64_t i = 0; i < n; ++i) {
      const __m512 wi = _mm512_set1_ps(w[i]);
      for (int j = 0; j < 4; ++j) r[j] = _mm512_fmadd_ps(wi, codes16_avx512(rows[i] + d + 16 * j), r[j]);
    }
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + d + 16 * j, r[j]);
  }
  for (; d + 16 <= D; d += 16) {
    __m512 r = _mm512_loadu_ps(acc + d);
    for (int64_t i = 0; i < n; ++i) r = _mm512_fmadd_ps(_mm512_set1_ps(w[i]), codes16_avx512(rows[i] + d), r);
    _mm512_storeu_ps(acc + d, r);
  }
  for (; d < D; ++d) {
    float r = acc[d];
    for (int64_t i = 0; i < n; ++i) r += w[i] * static_cast<float>(rows[i][d]);
    acc[d] = r;
  }
}

#endif  // STAGEWISE_HAVE_AVX2_PATH

}  // namespace stagewise::cpu
