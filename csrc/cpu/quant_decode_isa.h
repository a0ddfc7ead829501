// Vector decoders of the GGUF sub-blocks (cpu/quant_blocks.h) for one ISA level, included once
// per level inside its namespace (no include guard, by design) with
//   STAGEWISE_Q_LEVEL   1 (AVX2), 2 (AVX-512) or 3 (AVX-512 VNNI): the Isa of cpu/isa.h;
//   STAGEWISE_Q_TARGET  the function attribute of that level.
// Every function carries the attribute, so the intrinsics inline into the copy that uses them.
#define STAGEWISE_QD_INLINE STAGEWISE_ALWAYS_INLINE STAGEWISE_Q_TARGET

// fp16 at p -> float32 through F16C.
STAGEWISE_QD_INLINE float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The block's fp16 d and min (quant_blocks.h: Block<Q>::kD, kM) as float32; d and m side by side
// (kM = kD + 2) in one conversion.
template <QType Q>
STAGEWISE_QD_INLINE void block_d_m(const uint8_t* blk, float* d, float* m) {
  if constexpr (Block<Q>::kM == Block<Q>::kD + 2) {
    int32_t both;
    std::memcpy(&both, blk + Block<Q>::kD, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(both));
    *d = _mm_cvtss_f32(f);
    *m = _mm_cvtss_f32(_mm_movehdup_ps(f));
  } else {
    *d = half_at(blk + Block<Q>::kD);
    *m = 0.f;
  }
}

STAGEWISE_QD_INLINE __m256i srl16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }

// The 32 quants of sub-block `sub` of the block at blk, byte i = weight i (Q8_0: int8 bits).
template <QType Q>
STAGEWISE_QD_INLINE __m256i sub_bytes(const uint8_t* blk, int sub) {
  const __m256i low4 = _mm256_set1_epi8(15);
  if constexpr (Q == QType::kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else if constexpr (Q == QType::kQ4_0 || Q == QType::kQ4_1) {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (Q == QType::kQ4_1 ? 4 : 2)));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), low4);
  } else if constexpr (Q == QType::kQ4_K) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * (sub / 2)));
    return _mm256_and_si256(srl16(qs, 4 * (sub % 2)), low4);
  } else {  // Q6_K, see quant.h: 4 low bits from ql, 2 high bits from qh
    const int h = sub / 4, r = sub % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (r % 2)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(srl16(ql, 4 * (r / 2)), low4);
    const __m256i hi = _mm256_and_si256(srl16(qh, 2 * r), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
}

STAGEWISE_QD_INLINE float hsum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

#if STAGEWISE_Q_LEVEL >= 2
constexpr int kVecLanes = 16;  // floats a vector
using VF = __m512;
STAGEWISE_QD_INLINE VF vload(const float* p) { return _mm512_loadu_ps(p); }
STAGEWISE_QD_INLINE void vstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
STAGEWISE_QD_INLINE VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
STAGEWISE_QD_INLINE VF vzero() { return _mm512_setzero_ps(); }
STAGEWISE_QD_INLINE float vsum(VF v) { return _mm512_reduce_add_ps(v); }
#else
constexpr int kVecLanes = 8;
using VF = __m256;
STAGEWISE_QD_INLINE VF vload(const float* p) { return _mm256_loadu_ps(p); }
STAGEWISE_QD_INLINE void vstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
STAGEWISE_QD_INLINE VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
STAGEWISE_QD_INLINE VF vzero() { return _mm256_setzero_ps(); }
STAGEWISE_QD_INLINE float vsum(VF v) { return hsum256(v); }
#endif
constexpr int kSubVectors = 32 / kVecLanes;  // vectors of one sub-block's weights

#if STAGEWISE_Q_LEVEL >= 2
using VI = __m512i;
STAGEWISE_QD_INLINE VI widen_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
STAGEWISE_QD_INLINE VI widen_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
STAGEWISE_QD_INLINE VI shr(VI v, int n) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(n)); }
STAGEWISE_QD_INLINE VI low_bits(VI v, int bits) { return _mm512_and_si512(v, _mm512_set1_epi32((1 << bits) - 1)); }
STAGEWISE_QD_INLINE VI or_shl4(VI lo, VI hi) { return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)); }
STAGEWISE_QD_INLINE VF to_float(VI v) { return _mm512_cvtepi32_ps(v); }
STAGEWISE_QD_INLINE VF vset1(float f) { return _mm512_set1_ps(f); }
STAGEWISE_QD_INLINE VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
#else
using VI = __m256i;
STAGEWISE_QD_INLINE VI widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
STAGEWISE_QD_INLINE VI widen_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
STAGEWISE_QD_INLINE VI shr(VI v, int n) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(n)); }
STAGEWISE_QD_INLINE VI low_bits(VI v, int bits) { return _mm256_and_si256(v, _mm256_set1_epi32((1 << bits) - 1)); }
STAGEWISE_QD_INLINE VI or_shl4(VI lo, VI hi) { return _mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)); }
STAGEWISE_QD_INLINE VF to_float(VI v) { return _mm256_cvtepi32_ps(v); }
STAGEWISE_QD_INLINE VF vset1(float f) { return _mm256_set1_ps(f); }
STAGEWISE_QD_INLINE VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
#endif

// The quants of weights [i0, i0 + kVecLanes) of sub-block `sub` as int32 lanes (Q8_0 signed; the
// offset of Q4_0 / Q6_K not taken off): each byte widened straight into its lane, the nibbles
// and bit fields cut there.
template <QType Q>
STAGEWISE_QD_INLINE VI lane_quants(const uint8_t* blk, int sub, int i0) {
  if constexpr (Q == QType::kQ8_0) {
    return widen_i8(blk + 2 + i0);
  } else if constexpr (Q == QType::kQ4_0 || Q == QType::kQ4_1) {  // weight i: byte i % 16, nibble i / 16
    const VI bytes = widen_u8(blk + (Q == QType::kQ4_1 ? 4 : 2) + i0 % 16);
    return i0 < 16 ? low_bits(bytes, 4) : shr(bytes, 4);  // a byte's high nibble needs no mask
  } else if constexpr (Q == QType::kQ4_K) {
    return low_bits(shr(widen_u8(blk + 16 + 32 * (sub / 2) + i0), 4 * (sub % 2)), 4);
  } else {  // Q6_K, quant.h: weight 128 h + r, r = 32 (sub % 4) + i
    const int h = sub / 4, r0 = 32 * (sub % 4);
    const VI lo = low_bits(shr(widen_u8(blk + 64 * h + r0 % 64 + i0), 4 * (r0 / 64)), 4);
    const VI hi = low_bits(shr(widen_u8(blk + 128 + 32 * h + i0), 2 * (r0 / 32)), 2);
    return or_shl4(lo, hi);
  }
}

// The exact-mode factors of every sub-block of one block: w = fma(q, a, b) per half, with b already
// less kOffset * a (quant_blocks.h). Computed once per block and row, for all of its sub-blocks.
template <QType Q>
struct Factors {
  float a[Block<Q>::kSubs][2], b[Block<Q>::kSubs][2];
};

template <QType Q>
STAGEWISE_QD_INLINE void block_factors(const uint8_t* blk, Factors<Q>& f) {
  float d, m;
  block_d_m<Q>(blk, &d, &m);
  for (int sub = 0; sub < Block<Q>::kSubs; ++sub) {
    sub_factors<Q>(d, m, blk, sub, f.a[sub], f.b[sub]);
    if constexpr (Block<Q>::kOffset != 0) {
      for (int h = 0; h < 2; ++h) f.b[sub][h] -= static_cast<float>(Block<Q>::kOffset) * f.a[sub][h];
    }
  }
}

// w[0, kSubVectors) = the 32 exact float32 weights of sub-block `sub` of the block at blk, whose
// factors are f: fma(q, a, b), one rounding; Q8_0, whose b is 0, as the product d * q alone.
template <QType Q>
STAGEWISE_QD_INLINE void sub_weights(const uint8_t* blk, int sub, const Factors<Q>& f, VF* w) {
  for (int v = 0; v < kSubVectors; ++v) {
    const int i0 = v * kVecLanes, h = i0 / 16;
    const VF q = to_float(lane_quants<Q>(blk, sub, i0));
    w[v] = Q == QType::kQ8_0 ? vmul(q, vset1(f.a[sub][h])) : vfma(q, vset1(f.a[sub][h]), vset1(f.b[sub][h]));
  }
}

#undef STAGEWISE_QD_INLINE
