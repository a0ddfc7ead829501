// quant_linear_int8 on the CPU: the reduced-precision mode of quant_linear, with x quantised to
// int8 per 32-block and integer block dot products (maths in include/stagewise/quant.h).
//
// x is quantised once per call (QuantizedX). W is split over panels of output features, one
// feature per int32 lane: a panel's blocks are regrouped into scratch so that vector j of block
// b holds weights [4j, 4j + 4) of every feature of the panel, as unsigned bytes. A row of x then
// meets a whole block of the panel in 8 dot-product instructions, each against 4 bytes of x
// broadcast to every lane, and one fused multiply-add applies the block's scales; the lanes are
// the outputs, so nothing is reduced across lanes at the end.
//   AVX-512 VNNI: vpdpbusd (u8 x s8, 4 products summed into each int32 lane, no saturation),
//     16 features a panel. Q8_0 weights are made unsigned by w + 128 (w ^ 0x80) and the
//     integer sum corrected by 128 * sum(q_x); Q4_0 nibbles are q and the sum is corrected by
//     8 * sum(q_x): the integer block sums are exact either way.
//   AVX2: vpmaddubsw + vpmaddwd, 8 features a panel. vpmaddubsw saturates its int16 pair sums,
//     which 4-bit weights (15 * 127 * 2) never reach; Q8_0 uses |w| and x with the sign of w
//     (2 * 128 * 127 fits) instead of the offset.
//   Other CPUs: plain integer loops.
#include "stagewise/quant.h"

#include <ATen/Parallel.h>

#include <cstdlib>
#include <string>

#include "cpu/cpu_utils.h"
#include "cpu/quant_prefetch.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define STAGEWISE_Q8_X86 1
#include <immintrin.h>
#define STAGEWISE_Q8_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define STAGEWISE_Q8_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace stagewise::cpu {
namespace {

// x [rows, K] quantised per block of 32: q = round_half_even(x / d), d = max|x| / 127 (0 if the
// block is zero), kept with s = sum(q) for the weight types' offset terms.
// 4 bytes of int8 read as one int32 (any alignment, any aliasing).
typedef int32_t I32 __attribute__((may_alias, aligned(1)));

struct QuantizedX {
  std::vector<int8_t> q;   // [rows, K]
  std::vector<float> d;    // [rows, nblocks]
  std::vector<int32_t> s;  // [rows, nblocks]
  std::vector<float> ds;   // [rows, nblocks] d * s in float32: Q4_1's m term
  int64_t K = 0, nblocks = 0;
};

float half_bits_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return to_float<F16>(h);
}

// One block: the scale from max|x|, then every value times its inverse rounded to nearest even.
// d and 1 / d are single float32 operations, so every ISA copy (and the reference) gets the same q.
STAGEWISE_ALWAYS_INLINE float block_scale(float amax, float* inv) {
  const float d = amax / 127.f;
  *inv = d != 0.f ? 1.f / d : 0.f;
  return d;
}

void quantize_x_scalar(const float* x, int64_t x_stride, int64_t rows, QuantizedX& qx) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t b = 0; b < qx.nblocks; ++b) {
      const float* xb = x + t * x_stride + b * kQuantBlock;
      float amax = 0.f, inv;
      for (int i = 0; i < kQuantBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      qx.d[t * qx.nblocks + b] = block_scale(amax, &inv);
      int32_t s = 0;
      for (int i = 0; i < kQuantBlock; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(xb[i] * inv));  // default mode: ties to even
        qx.q[t * qx.K + b * kQuantBlock + i] = static_cast<int8_t>(q);
        s += q;
      }
      qx.s[t * qx.nblocks + b] = s;
    }
  }
}

// Stores lanes [0, n) of acc (+ bias) as out[0, n) in D.
template <typename D>
STAGEWISE_ALWAYS_INLINE void store_lanes(const float* acc, int64_t n, const float* bias, Storage<D>* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = from_float<D>(acc[j] + (bias ? bias[j] : 0.f));
}

// ---- plain integer loops ----------------------------------------------------------

template <QType Q, typename D>
void features_scalar(const QuantLinearParams& p, const QuantizedX& qx, const float* bias, int64_t begin,
                     int64_t end) {
  constexpr int64_t kBytes = quant_block_bytes(Q);
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = p.qweight + n * qx.nblocks * kBytes;
    for (int64_t t = 0; t < p.rows; ++t) {
      float acc = 0.f;
      for (int64_t b = 0; b < qx.nblocks; ++b) {
        const uint8_t* blk = row + b * kBytes;
        const int8_t* xq = qx.q.data() + t * qx.K + b * kQuantBlock;
        int32_t isum = 0;
        for (int i = 0; i < kQuantBlock; ++i) {
          int32_t w;
          if constexpr (Q == QType::kQ8_0) {
            w = static_cast<int8_t>(blk[2 + i]);
          } else {
            const uint8_t byte = blk[(Q == QType::kQ4_1 ? 4 : 2) + i % 16];
            w = i < 16 ? byte & 15 : byte >> 4;
            if constexpr (Q == QType::kQ4_0) w -= 8;
          }
          isum += w * xq[i];
        }
        const float dx = qx.d[t * qx.nblocks + b];
        acc += half_bits_to_float(blk) * dx * static_cast<float>(isum);
        if constexpr (Q == QType::kQ4_1) {
          acc += half_bits_to_float(blk + 2) * qx.ds[t * qx.nblocks + b];
        }
      }
      store_lanes<D>(&acc, 1, bias ? bias + n : nullptr, static_cast<Storage<D>*>(p.out) + t * p.out_row_stride + n);
    }
  }
}

#ifdef STAGEWISE_Q8_X86
// ---- AVX-512 VNNI -----------------------------------------------------------------

STAGEWISE_Q8_AVX512 void quantize_x_avx512(const float* x, int64_t x_stride, int64_t rows, QuantizedX& qx) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t b = 0; b < qx.nblocks; ++b) {
      const float* xb = x + t * x_stride + b * kQuantBlock;
      const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      float inv;
      qx.d[t * qx.nblocks + b] =
          block_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi))), &inv);
      const __m512 vinv = _mm512_set1_ps(inv);
      // cvtps rounds by MXCSR: nearest even unless a caller changed it, as nearbyint does.
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));
      int8_t* dst = qx.q.data() + t * qx.K + b * kQuantBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(qhi));
      qx.s[t * qx.nblocks + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
  }
}

constexpr int kRows512 = 8;
constexpr int64_t kPrefetchPanels = 2;  // how far ahead the weight bytes are requested  // rows of x per pass over a panel: 8 weight vectors + 8 sums + temporaries

// One pass: rows [t, t + kMR) of x against the regrouped panel; out rows get features [n0, n0 + nc).
template <QType Q, typename D, int kMR>
STAGEWISE_Q8_AVX512 void rows_avx512(const QuantLinearParams& p, const QuantizedX& qx, const float* bias,
                                     const int32_t* wq, const float* wd, const float* wm, int64_t t,
                                     int64_t n0, int64_t nc) {
  constexpr int32_t kOffset = Q == QType::kQ8_0 ? 128 : Q == QType::kQ4_0 ? 8 : 0;
  const int64_t K = qx.K, nb = qx.nblocks;
  const int8_t* xq = qx.q.data() + t * K;
  const float* dx = qx.d.data() + t * nb;
  const int32_t* sx = qx.s.data() + t * nb;
  const float* dsx = qx.ds.data() + t * nb;
  __m512 acc[kMR];
  for (int i = 0; i < kMR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(wq + (b * 8 + j) * 16);
    const __m512 d = _mm512_loadu_ps(wd + b * 16);
    // Quant dword j of every row, then the next j: kMR independent dot-product chains in flight.
    __m512i isums[kMR];
#pragma GCC unroll 8
    for (int i = 0; i < kMR; ++i) isums[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
#pragma GCC unroll 8
      for (int i = 0; i < kMR; ++i) {
        const I32* x4 = reinterpret_cast<const I32*>(xq + i * K + b * kQuantBlock);
        isums[i] = _mm512_dpbusd_epi32(isums[i], w[j], _mm512_set1_epi32(x4[j]));
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < kMR; ++i) {
      __m512i isum = isums[i];
      if constexpr (kOffset != 0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(kOffset * sx[i * nb + b]));
      const float dxi = dx[i * nb + b];
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(dxi)), acc[i]);
      if constexpr (Q == QType::kQ4_1) {
        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(wm + b * 16), _mm512_set1_ps(dsx[i * nb + b]), acc[i]);
      }
    }
  }
  for (int i = 0; i < kMR; ++i) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc[i]);
    store_lanes<D>(lanes, nc, bias ? bias + n0 : nullptr,
                   static_cast<Storage<D>*>(p.out) + (t + i) * p.out_row_stride + n0);
  }
}

template <QType Q, typename D, int kMR>
STAGEWISE_Q8_AVX512 void rows_avx512_tail(int mr, const QuantLinearParams& p, const QuantizedX& qx,
                                          const float* bias, const int32_t* wq, const float* wd,
                                          const float* wm, int64_t t, int64_t n0, int64_t nc) {
  if constexpr (kMR > 1) {
    if (mr < kMR) return rows_avx512_tail<Q, D, kMR - 1>(mr, p, qx, bias, wq, wd, wm, t, n0, nc);
  }
  rows_avx512<Q, D, kMR>(p, qx, bias, wq, wd, wm, t, n0, nc);
}

// dword m of each 128-bit lane of z[0..3] -> the lanes of o[m]: o[m] lane 4L + k = z[k] lane L dword m.
STAGEWISE_Q8_AVX512 STAGEWISE_ALWAYS_INLINE void transpose4_avx512(const __m512i* z, __m512i* o) {
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  o[0] = _mm512_unpacklo_epi64(t0, t2);
  o[1] = _mm512_unpackhi_epi64(t0, t2);
  o[2] = _mm512_unpacklo_epi64(t1, t3);
  o[3] = _mm512_unpackhi_epi64(t1, t3);
}

// The quants of one block of 16 features (feature l at qs + offsets[l]) regrouped: w[j * 16 + l]
// = weights [4j, 4j + 4) of feature l as unsigned bytes (Q8_0: w + 128).
template <QType Q>
STAGEWISE_Q8_AVX512 STAGEWISE_ALWAYS_INLINE void regroup_block_avx512(const uint8_t* qs, const int32_t* offsets,
                                                                      int32_t* w) {
  auto xmm = [&](int l, int at) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + offsets[l] + at)); };
  if constexpr (Q == QType::kQ8_0) {
    // z[k]: features k, k + 8 (32 bytes each); z[k + 4]: features k + 4, k + 12.
    __m512i z[8], o[8];
    for (int k = 0; k < 8; ++k) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + offsets[k]));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + offsets[k + 8]));
      z[k] = _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1);
    }
    transpose4_avx512(z, o);      // o[m] lanes: (0-3 dword m), (0-3 dword 4+m), (8-11 m), (8-11 4+m)
    transpose4_avx512(z + 4, o + 4);  // the same for features 4-7 and 12-15
    const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int m = 0; m < 4; ++m) {
      _mm512_storeu_si512(w + m * 16, _mm512_xor_si512(_mm512_permutex2var_epi64(o[m], lo, o[4 + m]), flip));
      _mm512_storeu_si512(w + (4 + m) * 16, _mm512_xor_si512(_mm512_permutex2var_epi64(o[m], hi, o[4 + m]), flip));
    }
  } else {
    // z[k] lane L: the 16 quant bytes of feature 4L + k; byte c of dword m holds weight 4m + c
    // (low nibble) and 16 + 4m + c (high nibble).
    __m512i z[4], o[4];
    for (int k = 0; k < 4; ++k) {
      __m512i v = _mm512_castsi128_si512(xmm(k, 0));
      v = _mm512_inserti32x4(v, xmm(4 + k, 0), 1);
      v = _mm512_inserti32x4(v, xmm(8 + k, 0), 2);
      z[k] = _mm512_inserti32x4(v, xmm(12 + k, 0), 3);
    }
    transpose4_avx512(z, o);
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int m = 0; m < 4; ++m) {
      _mm512_storeu_si512(w + m * 16, _mm512_and_si512(o[m], nibble));
      _mm512_storeu_si512(w + (4 + m) * 16, _mm512_and_si512(_mm512_srli_epi16(o[m], 4), nibble));
    }
  }
}

// Panels [begin, end) of 16 output features.
template <QType Q, typename D>
STAGEWISE_Q8_AVX512 void panels_avx512(const QuantLinearParams& p, const QuantizedX& qx, const float* bias,
                                       int64_t begin, int64_t end) {
  constexpr int64_t kBytes = quant_block_bytes(Q);
  constexpr int kQs = Q == QType::kQ4_1 ? 4 : 2;  // byte offset of the quants in a block
  const int64_t nb = qx.nblocks, row_bytes = nb * kBytes;
  // The regrouped panel: 8 vectors of 16 lanes a block, the scales d (and m) of 16 lanes a block.
  std::vector<int32_t> wq(nb * 8 * 16);
  std::vector<float> wd(nb * 16), wm(Q == QType::kQ4_1 ? nb * 16 : 0);
  for (int64_t pi = begin; pi < end; ++pi) {
    const int64_t n0 = pi * 16, nc = std::min<int64_t>(16, p.out_features - n0);
    // Lane l is feature n0 + l; lanes past the last feature repeat it and are never stored.
    alignas(64) int32_t offsets[16];
    for (int l = 0; l < 16; ++l) offsets[l] = static_cast<int32_t>(std::min<int64_t>(l, nc - 1) * row_bytes);
    const __m512i vindex = _mm512_load_si512(offsets);
    const uint8_t* base = p.qweight + n0 * row_bytes;
    PanelPrefetch ahead(base, 16 * row_bytes, nb, pi + kPrefetchPanels < end);
    for (int64_t b = 0; b < nb; ++b) {
      ahead.next();
      const uint8_t* blk = base + b * kBytes;
      const __m512i scales = _mm512_i32gather_epi32(vindex, blk, 1);  // d, then m (Q4_1) or the first quants
      _mm512_storeu_ps(wd.data() + b * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(scales)));
      if constexpr (Q == QType::kQ4_1) {
        _mm512_storeu_ps(wm.data() + b * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(scales, 16))));
      }
      regroup_block_avx512<Q>(blk + kQs, offsets, wq.data() + b * 8 * 16);
    }
    for (int64_t t = 0; t < p.rows; t += kRows512) {
      const int mr = static_cast<int>(std::min<int64_t>(kRows512, p.rows - t));
      rows_avx512_tail<Q, D, kRows512>(mr, p, qx, bias, wq.data(), wd.data(), wm.data(), t, n0, nc);
    }
  }
}

// ---- AVX2 -------------------------------------------------------------------------

constexpr int kRows256 = 4;

template <QType Q, typename D, int kMR>
STAGEWISE_Q8_AVX2 void rows_avx2(const QuantLinearParams& p, const QuantizedX& qx, const float* bias,
                                 const int32_t* wq, const float* wd, const float* wm, int64_t t, int64_t n0,
                                 int64_t nc) {
  constexpr int32_t kOffset = Q == QType::kQ4_0 ? 8 : 0;  // Q8_0: signed weights, see the top of the file
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[kMR];
  for (int i = 0; i < kMR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < qx.nblocks; ++b) {
    __m256i w[8];
    for (int j = 0; j < 8; ++j) w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + (b * 8 + j) * 8));
    const __m256 d = _mm256_loadu_ps(wd + b * 8);
#pragma GCC unroll 4
    for (int i = 0; i < kMR; ++i) {
      const int64_t xb = (t + i) * qx.nblocks + b;
      int32_t x4[8];
      std::memcpy(x4, qx.q.data() + (t + i) * qx.K + b * kQuantBlock, sizeof(x4));
      __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m256i xv = _mm256_set1_epi32(x4[j]), wv = w[j];
        if constexpr (Q == QType::kQ8_0) {
          xv = _mm256_sign_epi8(xv, wv);
          wv = _mm256_abs_epi8(wv);
        }
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones));
      }
      if constexpr (kOffset != 0) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(kOffset * qx.s[xb]));
      const float dx = qx.d[xb];
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[i]);
      if constexpr (Q == QType::kQ4_1) {
        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(wm + b * 8), _mm256_set1_ps(qx.ds[xb]), acc[i]);
      }
    }
  }
  for (int i = 0; i < kMR; ++i) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[i]);
    store_lanes<D>(lanes, nc, bias ? bias + n0 : nullptr,
                   static_cast<Storage<D>*>(p.out) + (t + i) * p.out_row_stride + n0);
  }
}

template <QType Q, typename D, int kMR>
STAGEWISE_Q8_AVX2 void rows_avx2_tail(int mr, const QuantLinearParams& p, const QuantizedX& qx, const float* bias,
                                      const int32_t* wq, const float* wd, const float* wm, int64_t t,
                                      int64_t n0, int64_t nc) {
  if constexpr (kMR > 1) {
    if (mr < kMR) return rows_avx2_tail<Q, D, kMR - 1>(mr, p, qx, bias, wq, wd, wm, t, n0, nc);
  }
  rows_avx2<Q, D, kMR>(p, qx, bias, wq, wd, wm, t, n0, nc);
}

// Panels [begin, end) of 8 output features.
template <QType Q, typename D>
STAGEWISE_Q8_AVX2 void panels_avx2(const QuantLinearParams& p, const QuantizedX& qx, const float* bias,
                                   int64_t begin, int64_t end) {
  constexpr int64_t kBytes = quant_block_bytes(Q);
  constexpr int kQs = Q == QType::kQ4_1 ? 4 : 2;
  const int64_t nb = qx.nblocks, row_bytes = nb * kBytes;
  std::vector<int32_t> wq(nb * 8 * 8);
  std::vector<float> wd(nb * 8), wm(Q == QType::kQ4_1 ? nb * 8 : 0);
  const __m256i nibble = _mm256_set1_epi8(15), low16 = _mm256_set1_epi32(0xFFFF);
  for (int64_t pi = begin; pi < end; ++pi) {
    const int64_t n0 = pi * 8, nc = std::min<int64_t>(8, p.out_features - n0);
    alignas(32) int32_t offsets[8];
    for (int l = 0; l < 8; ++l) offsets[l] = static_cast<int32_t>(std::min<int64_t>(l, nc - 1) * row_bytes);
    const __m256i vindex = _mm256_load_si256(reinterpret_cast<const __m256i*>(offsets));
    const uint8_t* base = p.qweight + n0 * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = base + b * kBytes;
      const __m256i scales = _mm256_i32gather_epi32(reinterpret_cast<const int*>(blk), vindex, 1);
      // Two fp16 values per int32 lane: convert the low halves, then the high halves.
      const __m256i d16 = _mm256_and_si256(scales, low16);
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(d16, d16), 0x08);
      _mm256_storeu_ps(wd.data() + b * 8, _mm256_cvtph_ps(_mm256_castsi256_si128(packed)));
      if constexpr (Q == QType::kQ4_1) {
        const __m256i m16 = _mm256_srli_epi32(scales, 16);
        const __m256i mpacked = _mm256_permute4x64_epi64(_mm256_packus_epi32(m16, m16), 0x08);
        _mm256_storeu_ps(wm.data() + b * 8, _mm256_cvtph_ps(_mm256_castsi256_si128(mpacked)));
      }
      auto* w = reinterpret_cast<__m256i*>(wq.data() + b * 8 * 8);
      if constexpr (Q == QType::kQ8_0) {
        for (int j = 0; j < 8; ++j) {
          _mm256_storeu_si256(w + j, _mm256_i32gather_epi32(reinterpret_cast<const int*>(blk + kQs + 4 * j), vindex, 1));
        }
      } else {
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_i32gather_epi32(reinterpret_cast<const int*>(blk + kQs + 4 * j), vindex, 1);
          _mm256_storeu_si256(w + j, _mm256_and_si256(v, nibble));
          _mm256_storeu_si256(w + 4 + j, _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble));
        }
      }
    }
    for (int64_t t = 0; t < p.rows; t += kRows256) {
      const int mr = static_cast<int>(std::min<int64_t>(kRows256, p.rows - t));
      rows_avx2_tail<Q, D, kRows256>(mr, p, qx, bias, wq.data(), wd.data(), wm.data(), t, n0, nc);
    }
  }
}
#endif  // STAGEWISE_Q8_X86

enum class Isa { kAvx512Vnni, kAvx2, kScalar };

Isa detect_isa();

// The best copy this CPU runs, or a lesser one named by STAGEWISE_INT8_ISA ("avx2" or
// "scalar"), read once: so that tests reach every copy on one machine.
Isa best_isa() {
  static const Isa isa = [] {
    const char* env = std::getenv("STAGEWISE_INT8_ISA");
    const std::string cap = env ? env : "";
    TORCH_CHECK_VALUE(cap.empty() || cap == "avx512vnni" || cap == "avx2" || cap == "scalar",
                      "stagewise.quant_linear_int8: STAGEWISE_INT8_ISA must be avx512vnni, avx2 or scalar, got '",
                      cap, "'");
    const Isa best = detect_isa();
    if (cap == "scalar") return Isa::kScalar;
    if (cap == "avx2" && best == Isa::kAvx512Vnni) return Isa::kAvx2;
    return best;
  }();
  return isa;
}

Isa detect_isa() {
#ifdef STAGEWISE_Q8_X86
  {
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
      return Isa::kAvx512Vnni;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
      return Isa::kAvx2;
    }
    return Isa::kScalar;
  }
#else
  return Isa::kScalar;
#endif
}

template <QType Q, typename D>
void run(const QuantLinearParams& p, const QuantizedX& qx, const float* bias, Isa isa) {
  const int64_t K = p.in_features;
#ifdef STAGEWISE_Q8_X86
  if (isa == Isa::kAvx512Vnni || isa == Isa::kAvx2) {
    const int64_t lanes = isa == Isa::kAvx512Vnni ? 16 : 8;
    const int64_t num_panels = (p.out_features + lanes - 1) / lanes;
    at::parallel_for(0, num_panels, grain_for(lanes * K * p.rows), [&](int64_t begin, int64_t end) {
      if (isa == Isa::kAvx512Vnni) {
        panels_avx512<Q, D>(p, qx, bias, begin, end);
      } else {
        panels_avx2<Q, D>(p, qx, bias, begin, end);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, p.out_features, grain_for(K * p.rows), [&](int64_t begin, int64_t end) {
    features_scalar<Q, D>(p, qx, bias, begin, end);
  });
}

}  // namespace

void quant_linear_int8(const QuantLinearParams& p) {
  if (p.rows == 0 || p.out_features == 0) return;
  const int64_t K = p.in_features;
  const Isa isa = best_isa();
  QuantizedX qx;
  qx.K = K;
  qx.nblocks = K / kQuantBlock;
  qx.q.resize(p.rows * K);
  qx.d.resize(p.rows * qx.nblocks);
  qx.s.resize(p.rows * qx.nblocks);
  qx.ds.resize(p.rows * qx.nblocks);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using D = decltype(tag);
    std::vector<float> x_buf, bias_buf;
    const float* x = static_cast<const float*>(p.x);
    int64_t x_stride = p.x_row_stride;
    if constexpr (!std::is_same_v<D, F32>) {  // activations to float32 first
      x_buf.resize(p.rows * K);
      for (int64_t t = 0; t < p.rows; ++t) {
        load_block<D>(static_cast<const Storage<D>*>(p.x) + t * p.x_row_stride, x_buf.data() + t * K, K);
      }
      x = x_buf.data();
      x_stride = K;
    }
#ifdef STAGEWISE_Q8_X86
    if (isa == Isa::kAvx512Vnni) {
      quantize_x_avx512(x, x_stride, p.rows, qx);
    } else {
      quantize_x_scalar(x, x_stride, p.rows, qx);
    }
#else
    quantize_x_scalar(x, x_stride, p.rows, qx);
#endif
    for (size_t i = 0; i < qx.ds.size(); ++i) qx.ds[i] = qx.d[i] * static_cast<float>(qx.s[i]);
    const float* bias = p.bias != nullptr ? as_float<D>(p.bias, p.out_features, bias_buf) : nullptr;
    switch (p.qtype) {
      case QType::kQ4_0: return run<QType::kQ4_0, D>(p, qx, bias, isa);
      case QType::kQ4_1: return run<QType::kQ4_1, D>(p, qx, bias, isa);
      case QType::kQ8_0: return run<QType::kQ8_0, D>(p, qx, bias, isa);
    }
    TORCH_CHECK(false, "stagewise.quant_linear_int8: unknown qtype ", static_cast<int>(p.qtype));
  });
}

}  // namespace stagewise::cpu
