// The int8-mode kernel of quant_linear_int8 for one x86 ISA level, included once per level by
// quant_linear_int8.cpp inside the level's namespace (no include guard, by design) with
//   STAGEWISE_Q_LEVEL   1 (AVX2), 2 (AVX-512) or 3 (AVX-512 VNNI): the Isa of cpu/isa.h;
//   STAGEWISE_Q_TARGET  the function attribute of that level.
//
// The weights come as panels (cpu/quant_pack.h): one weight row per 32-bit lane, 4 consecutive
// weights of it per lane of a vector. A sub-block of 32 weights of a whole panel is 8 vectors,
// each met by one dword of x (4 int8 values) broadcast to every lane, so each lane sums its own
// row and nothing is reduced across lanes:
//   AVX-512 VNNI: vpdpbusd (u8 x s8, 4 products into each int32 lane, no saturation), 16 rows a
//     vector; Q8_0 weights are made unsigned by w + 128.
//   AVX-512, AVX2: vpmaddubsw (u8 x s8, pairs into int16) + vpmaddwd (pairs into int32), 16 or
//     8 rows a vector (AVX2 takes a panel in two halves). The int16 pair sums of the eight 4-bit
//     products are added in int16 before widening (8 x 2 x 15 x 127 fits); Q6_K's pairs of two
//     (2 x 2 x 63 x 127); Q8_0 takes |w| and x with the sign of w, as llama.cpp does.
// The weights' offsets (Q4_0 8, Q6_K 32, Q8_0 128 under VNNI) come off in the integer domain as
// -offset * sum(q_x) (per half of 16 for Q6_K, whose two scales multiply the integer half sums),
// so every lane is the exact integer block sum of quant.h; then one float32 fused multiply-add
// per lane with d * d_x, and for Q4_1 / Q4_K the min term m * (d_x * sum(q_x)).
#define STAGEWISE_Q_INLINE STAGEWISE_ALWAYS_INLINE STAGEWISE_Q_TARGET

namespace STAGEWISE_Q_NS {

#if STAGEWISE_Q_LEVEL >= 2
constexpr int kPassRows = 16;  // panel rows a vector holds
constexpr int kRows = 8;       // rows of x per pass: 8 accumulators + 8 weight vectors of 32 zmm
using IV = __m512i;
using FV = __m512;
STAGEWISE_Q_INLINE IV load_iv(const uint8_t* p) { return _mm512_loadu_si512(p); }
STAGEWISE_Q_INLINE IV set1_i32(int32_t v) { return _mm512_set1_epi32(v); }
STAGEWISE_Q_INLINE IV set1_i8(int8_t v) { return _mm512_set1_epi8(v); }
STAGEWISE_Q_INLINE IV iand(IV a, IV b) { return _mm512_and_si512(a, b); }
STAGEWISE_Q_INLINE IV ior(IV a, IV b) { return _mm512_or_si512(a, b); }
STAGEWISE_Q_INLINE IV ixor(IV a, IV b) { return _mm512_xor_si512(a, b); }
STAGEWISE_Q_INLINE IV srl16(IV a, int n) { return _mm512_srl_epi16(a, _mm_cvtsi32_si128(n)); }
STAGEWISE_Q_INLINE IV sll16(IV a, int n) { return _mm512_sll_epi16(a, _mm_cvtsi32_si128(n)); }
STAGEWISE_Q_INLINE IV add32(IV a, IV b) { return _mm512_add_epi32(a, b); }
STAGEWISE_Q_INLINE IV add16(IV a, IV b) { return _mm512_add_epi16(a, b); }
STAGEWISE_Q_INLINE IV mul32(IV a, IV b) { return _mm512_mullo_epi32(a, b); }
STAGEWISE_Q_INLINE IV maddubs(IV w, IV x) { return _mm512_maddubs_epi16(w, x); }
STAGEWISE_Q_INLINE IV madd_ones(IV v) { return _mm512_madd_epi16(v, _mm512_set1_epi16(1)); }
STAGEWISE_Q_INLINE IV abs8(IV v) { return _mm512_abs_epi8(v); }
STAGEWISE_Q_INLINE IV sign8(IV x, IV w) {  // x where w > 0, -x where w < 0 (w = 0: |w| = 0 anyway)
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
STAGEWISE_Q_INLINE IV widen_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
STAGEWISE_Q_INLINE IV widen_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
STAGEWISE_Q_INLINE FV half_to_float(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
STAGEWISE_Q_INLINE FV to_float(IV v) { return _mm512_cvtepi32_ps(v); }
STAGEWISE_Q_INLINE FV fset1(float f) { return _mm512_set1_ps(f); }
STAGEWISE_Q_INLINE FV fmul(FV a, FV b) { return _mm512_mul_ps(a, b); }
STAGEWISE_Q_INLINE FV fneg(FV a) { return _mm512_sub_ps(_mm512_setzero_ps(), a); }
STAGEWISE_Q_INLINE FV ffma(FV a, FV b, FV c) { return _mm512_fmadd_ps(a, b, c); }
STAGEWISE_Q_INLINE FV fzero() { return _mm512_setzero_ps(); }
STAGEWISE_Q_INLINE void fstore(float* p, FV v) { _mm512_storeu_ps(p, v); }
#else
constexpr int kPassRows = 8;
constexpr int kRows = 4;  // 4 accumulators + 8 weight vectors of 16 ymm
using IV = __m256i;
using FV = __m256;
STAGEWISE_Q_INLINE IV load_iv(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
STAGEWISE_Q_INLINE IV set1_i32(int32_t v) { return _mm256_set1_epi32(v); }
STAGEWISE_Q_INLINE IV set1_i8(int8_t v) { return _mm256_set1_epi8(v); }
STAGEWISE_Q_INLINE IV iand(IV a, IV b) { return _mm256_and_si256(a, b); }
STAGEWISE_Q_INLINE IV ior(IV a, IV b) { return _mm256_or_si256(a, b); }
STAGEWISE_Q_INLINE IV ixor(IV a, IV b) { return _mm256_xor_si256(a, b); }
STAGEWISE_Q_INLINE IV srl16(IV a, int n) { return _mm256_srl_epi16(a, _mm_cvtsi32_si128(n)); }
STAGEWISE_Q_INLINE IV sll16(IV a, int n) { return _mm256_sll_epi16(a, _mm_cvtsi32_si128(n)); }
STAGEWISE_Q_INLINE IV add32(IV a, IV b) { return _mm256_add_epi32(a, b); }
STAGEWISE_Q_INLINE IV add16(IV a, IV b) { return _mm256_add_epi16(a, b); }
STAGEWISE_Q_INLINE IV mul32(IV a, IV b) { return _mm256_mullo_epi32(a, b); }
STAGEWISE_Q_INLINE IV maddubs(IV w, IV x) { return _mm256_maddubs_epi16(w, x); }
STAGEWISE_Q_INLINE IV madd_ones(IV v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }
STAGEWISE_Q_INLINE IV abs8(IV v) { return _mm256_abs_epi8(v); }
STAGEWISE_Q_INLINE IV sign8(IV x, IV w) { return _mm256_sign_epi8(x, w); }
STAGEWISE_Q_INLINE IV widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
STAGEWISE_Q_INLINE IV widen_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
STAGEWISE_Q_INLINE FV half_to_float(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
STAGEWISE_Q_INLINE FV to_float(IV v) { return _mm256_cvtepi32_ps(v); }
STAGEWISE_Q_INLINE FV fset1(float f) { return _mm256_set1_ps(f); }
STAGEWISE_Q_INLINE FV fmul(FV a, FV b) { return _mm256_mul_ps(a, b); }
STAGEWISE_Q_INLINE FV fneg(FV a) { return _mm256_sub_ps(_mm256_setzero_ps(), a); }
STAGEWISE_Q_INLINE FV ffma(FV a, FV b, FV c) { return _mm256_fmadd_ps(a, b, c); }
STAGEWISE_Q_INLINE FV fzero() { return _mm256_setzero_ps(); }
STAGEWISE_Q_INLINE void fstore(float* p, FV v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int kPasses = static_cast<int>(kPanelRows / kPassRows);

// The integer offset taken off the weights through x's sums (0: none).
template <QType Q>
constexpr int32_t kXOffset = Q == QType::kQ8_0 ? (STAGEWISE_Q_LEVEL >= 3 ? 128 : 0) : Block<Q>::kOffset;

// Blocks of 32 values of x [rows, K] quantised (QuantizedX), 8 at a time in AVX2 vectors: the same
// float32 operations as the scalar loop, so the same q.
STAGEWISE_Q_TARGET void quantize_x(const float* x, int64_t x_stride, int64_t rows, QuantizedX& qx) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs interleave the 128-bit lanes
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t b = 0; b < qx.nblocks; ++b) {
      const float* xb = x + t * x_stride + b * kQuantBlock;
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int k = 0; k < 4; ++k) {
        v[k] = _mm256_loadu_ps(xb + 8 * k);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
      }
      __m128 mx = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
      mx = _mm_max_ss(mx, _mm_movehdup_ps(mx));
      float inv;
      const int64_t at = t * qx.nblocks + b;
      qx.d[at] = block_scale(_mm_cvtss_f32(mx), &inv);
      const __m256 vinv = _mm256_set1_ps(inv);
      __m256i qi[4];  // cvtps rounds by MXCSR: nearest even unless a caller changed it, as nearbyint does
      for (int k = 0; k < 4; ++k) qi[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vinv));
      const __m256i q16 = _mm256_packs_epi32(qi[0], qi[1]), q16b = _mm256_packs_epi32(qi[2], qi[3]);
      const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16, q16b), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx.q.data() + t * qx.K + b * kQuantBlock), q8);
      alignas(32) int32_t lanes[8];  // sums of 4 consecutive q
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q8), ones16));
      const int32_t lo = lanes[0] + lanes[1] + lanes[2] + lanes[3], hi = lanes[4] + lanes[5] + lanes[6] + lanes[7];
      qx.sums[2 * at] = lo;
      qx.sums[2 * at + 1] = hi;
      qx.ds[at] = qx.d[at] * static_cast<float>(lo + hi);
    }
  }
}

STAGEWISE_Q_INLINE int32_t x_dword(const int8_t* xq, int j) {
  int32_t v;
  std::memcpy(&v, xq + 4 * j, 4);
  return v;
}

// The 8 weight vectors of one sub-block (its quants at q, this pass's lanes at q + lane_bytes).
template <QType Q>
STAGEWISE_Q_INLINE void weights(const uint8_t* q, int64_t lane_bytes, IV* w) {
  if constexpr (Q == QType::kQ8_0) {
    for (int j = 0; j < 8; ++j) {
      w[j] = load_iv(q + 64 * j + lane_bytes);
      if constexpr (STAGEWISE_Q_LEVEL >= 3) w[j] = ixor(w[j], set1_i8(static_cast<int8_t>(0x80)));
    }
  } else {
    const IV low4 = set1_i8(15);
    for (int m = 0; m < 4; ++m) {
      const IV c = load_iv(q + 64 * m + lane_bytes);
      w[m] = iand(c, low4);
      w[4 + m] = iand(srl16(c, 4), low4);
    }
    if constexpr (Q == QType::kQ6_K) {
      const IV low2 = set1_i8(3);
      for (int k = 0; k < 2; ++k) {
        const IV h = load_iv(q + 256 + 64 * k + lane_bytes);
        for (int s = 0; s < 4; ++s) w[4 * k + s] = ior(w[4 * k + s], sll16(iand(srl16(h, 2 * s), low2), 4));
      }
    }
  }
}

// sum over j of w[j] . x dword j, per lane, starting from `init` (lanes: int32).
template <QType Q>
STAGEWISE_Q_INLINE IV dot(const IV* w, const IV* wabs, const int8_t* xq, IV init, int j0, int j1) {
#if STAGEWISE_Q_LEVEL >= 3
  IV a = init, b = set1_i32(0);  // two chains
  for (int j = j0; j < j1; j += 2) {
    a = _mm512_dpbusd_epi32(a, w[j], set1_i32(x_dword(xq, j)));
    b = _mm512_dpbusd_epi32(b, w[j + 1], set1_i32(x_dword(xq, j + 1)));
  }
  return add32(a, b);
#else
  if constexpr (Q == QType::kQ8_0) {
    IV acc = init;
    for (int j = j0; j < j1; ++j) acc = add32(acc, madd_ones(maddubs(wabs[j], sign8(set1_i32(x_dword(xq, j)), w[j]))));
    return acc;
  } else if constexpr (Q == QType::kQ6_K) {  // int16 sums of two pairs fit (2 x 2 x 63 x 127)
    IV acc = init;
    for (int j = j0; j < j1; j += 2) {
      acc = add32(acc, madd_ones(add16(maddubs(w[j], set1_i32(x_dword(xq, j))),
                                       maddubs(w[j + 1], set1_i32(x_dword(xq, j + 1))))));
    }
    return acc;
  } else {  // 4-bit: the eight int16 pair sums fit (8 x 2 x 15 x 127)
    IV s = maddubs(w[j0], set1_i32(x_dword(xq, j0)));
    for (int j = j0 + 1; j < j1; ++j) s = add16(s, maddubs(w[j], set1_i32(x_dword(xq, j))));
    return add32(madd_ones(s), init);
  }
#endif
}

// One pass: lanes [pass * kPassRows, + kPassRows) of the panel at `panel` against rows
// [t, t + kR) of x; acc[i * kPassRows + l] gets lane l's sum for row t + i.
template <QType Q, int kR>
STAGEWISE_Q_TARGET void pass(const uint8_t* panel, int pass_index, const QuantizedX& qx, int64_t t, float* acc,
                             StreamPrefetch* pf) {
  using P = Pack<Q>;
  const int64_t nblocks = qx.K / Block<Q>::kWeights;
  const int64_t lane_bytes = 4 * kPassRows * pass_index, half_bytes = 2 * kPassRows * pass_index;
  FV sum[kR];
  for (int i = 0; i < kR; ++i) sum[i] = fzero();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* rec = panel + b * P::kRecord;
    if (pf != nullptr) pf->reach(rec + P::kRecord);
    const FV d = half_to_float(rec + half_bytes);
    [[maybe_unused]] FV m = fzero();
    if constexpr (Q == QType::kQ4_1 || Q == QType::kQ4_K) m = half_to_float(rec + 32 + half_bytes);
    for (int sub = 0; sub < P::kSubs; ++sub) {
      const uint8_t* s = rec + P::kHeader + sub * P::kSub;
      IV w[8], wabs[8];
      weights<Q>(s + P::kQuants, lane_bytes, w);
      if constexpr (Q == QType::kQ8_0 && STAGEWISE_Q_LEVEL < 3) {
        for (int j = 0; j < 8; ++j) wabs[j] = abs8(w[j]);
      }
      FV scale = d, min = m;
      [[maybe_unused]] IV sc_lo, sc_hi;
      if constexpr (Q == QType::kQ4_K) {  // d * sc and -(dmin * mn), each exact in float32
        scale = fmul(d, to_float(widen_u8(s + lane_bytes / 4)));
        min = fneg(fmul(m, to_float(widen_u8(s + 16 + lane_bytes / 4))));
      } else if constexpr (Q == QType::kQ6_K) {
        sc_lo = widen_i8(s + lane_bytes / 4);
        sc_hi = widen_i8(s + 16 + lane_bytes / 4);
      }
      const int64_t xb = b * P::kSubs + sub;
      for (int i = 0; i < kR; ++i) {
        const int64_t at = (t + i) * qx.nblocks + xb;
        const int8_t* xq = qx.q.data() + (t + i) * qx.K + xb * kQuantBlock;
        const int32_t* xs = qx.sums.data() + 2 * at;  // sum(q_x) of each half
        IV isum;
        if constexpr (Q == QType::kQ6_K) {
          const IV lo = dot<Q>(w, wabs, xq, set1_i32(-32 * xs[0]), 0, 4);
          const IV hi = dot<Q>(w, wabs, xq, set1_i32(-32 * xs[1]), 4, 8);
          isum = add32(mul32(lo, sc_lo), mul32(hi, sc_hi));
        } else {
          isum = dot<Q>(w, wabs, xq, set1_i32(-kXOffset<Q> * (xs[0] + xs[1])), 0, 8);
        }
        sum[i] = ffma(to_float(isum), fmul(scale, fset1(qx.d[at])), sum[i]);
        if constexpr (Block<Q>::kHasMin) sum[i] = ffma(min, fset1(qx.ds[at]), sum[i]);
      }
    }
  }
  for (int i = 0; i < kR; ++i) fstore(acc + i * kPassRows, sum[i]);
}

template <QType Q, int kR>
STAGEWISE_Q_INLINE void pass_rows(int mr, const uint8_t* panel, int pass_index, const QuantizedX& qx, int64_t t,
                                  float* acc, StreamPrefetch* pf) {
  if constexpr (kR > 1) {
    if (mr < kR) return pass_rows<Q, kR - 1>(mr, panel, pass_index, qx, t, acc, pf);
  }
  pass<Q, kR>(panel, pass_index, qx, t, acc, pf);
}

// Panels [begin, end) against every row of x.
template <QType Q, typename D>
STAGEWISE_Q_TARGET void panels(const QuantLinearParams& p, const QuantizedX& qx, const float* bias, int64_t begin,
                               int64_t end) {
  const int64_t panel_bytes = p.in_features / Block<Q>::kWeights * Pack<Q>::kRecord;
  StreamPrefetch ahead(p.qweight + begin * panel_bytes, p.qweight + end * panel_bytes);
  for (int64_t pi = begin; pi < end; ++pi) {
    const uint8_t* panel = p.qweight + pi * panel_bytes;
    for (int h = 0; h < kPasses; ++h) {
      const int64_t n0 = pi * kPanelRows + h * kPassRows;
      const int64_t nr = std::min<int64_t>(kPassRows, p.out_features - n0);
      if (nr <= 0) break;
      for (int64_t t = 0; t < p.rows; t += kRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kRows, p.rows - t));
        alignas(64) float acc[kRows * kPassRows];
        pass_rows<Q, kRows>(mr, panel, h, qx, t, acc, t == 0 && h == 0 ? &ahead : nullptr);
        for (int i = 0; i < mr; ++i) {
          store_lanes<D>(acc + i * kPassRows, nr, bias ? bias + n0 : nullptr,
                         static_cast<Storage<D>*>(p.out) + (t + i) * p.out_row_stride + n0);
        }
      }
    }
  }
}

}  // namespace STAGEWISE_Q_NS

#undef STAGEWISE_Q_INLINE
