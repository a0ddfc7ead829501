// The GGUF block layouts of include/stagewise/quant.h as the CPU kernels read them: where a
// block's scales and quants are, and one 32-weight sub-block's
//   quants  q[0, 32)  (unsigned, Q8_0 signed), and
//   factors (a, b) of each half (weights 0-15, 16-31) such that the exact weight is
//           w = (q - kOffset) * a + b, where either the product is exact (b may be nonzero)
//           or b = 0 (Q6_K): one rounding, that of quant.h. With an FMA the same value is
//           fma(q, a, b - kOffset * a) (kOffset * a is exact: a power of two times a).
// Scalar and ISA-free; the vector decoders (quant_decode_isa.h) read the same offsets.
#pragma once
#include <cstdint>
#include <cstring>

#include "cpu/cpu_utils.h"
#include "stagewise/quant.h"

namespace stagewise::cpu {

template <QType Q>
struct Block {
  static constexpr int64_t kBytes = quant_block_bytes(Q);
  static constexpr int64_t kWeights = quant_block_weights(Q);
  static constexpr int kSubs = static_cast<int>(kWeights / kQuantBlock);  // sub-blocks of 32
  // Integer offset subtracted from every quant in the int8 mode's block sums (q - offset).
  static constexpr int32_t kOffset = Q == QType::kQ4_0 ? 8 : Q == QType::kQ6_K ? 32 : 0;
  // Whether the sub-block has a min term (Q4_1's m, Q4_K's -dmin * mn) added to its sums.
  static constexpr bool kHasMin = Q == QType::kQ4_1 || Q == QType::kQ4_K;
  // Byte offsets of the fp16 scale d and of the fp16 min (Q4_1 m, Q4_K dmin; -1: none).
  static constexpr int kD = Q == QType::kQ6_K ? 208 : 0;
  static constexpr int kM = kHasMin ? 2 : -1;
};

// f(QTag<Q>{}) for the QType q names (QTag<Q>::value is Q).
template <QType Q>
struct QTag {
  static constexpr QType value = Q;
};

template <typename F>
auto dispatch_qtype(QType q, F&& f) {
  switch (q) {
    case QType::kQ4_0: return f(QTag<QType::kQ4_0>{});
    case QType::kQ4_1: return f(QTag<QType::kQ4_1>{});
    case QType::kQ8_0: return f(QTag<QType::kQ8_0>{});
    case QType::kQ4_K: return f(QTag<QType::kQ4_K>{});
    case QType::kQ6_K: return f(QTag<QType::kQ6_K>{});
  }
  TORCH_CHECK(false, "stagewise: unknown GGUF block type ", static_cast<int>(q));
  return f(QTag<QType::kQ8_0>{});
}

// fp16 at p as float32, exactly, by bit arithmetic (any CPU); the ISA copies convert with F16C.
STAGEWISE_ALWAYS_INLINE float fp16_bits_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return to_float<F16>(h);
}

// The exact-mode factors of sub-block `sub` of the block at blk, whose fp16 d and min (at
// Block<Q>::kD, kM; 0 when there is none) the caller converted: w = (q - kOffset) * a[h] + b[h]
// for the weights of half h.
template <QType Q>
STAGEWISE_ALWAYS_INLINE void sub_factors(float d, float m, const uint8_t* blk, int sub, float* a, float* b) {
  if constexpr (Q == QType::kQ4_K) {
    int sc, mn;
    q4_k_scale_min(blk + 4, sub, &sc, &mn);
    a[0] = a[1] = d * static_cast<float>(sc);
    b[0] = b[1] = -(m * static_cast<float>(mn));
  } else if constexpr (Q == QType::kQ6_K) {  // (d * sc) * (q - 32), rounded once
    const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
    a[0] = d * static_cast<float>(sc[2 * sub]);
    a[1] = d * static_cast<float>(sc[2 * sub + 1]);
    b[0] = b[1] = 0.f;
  } else {  // Q4_0 d (q - 8), Q4_1 d q + m, Q8_0 d q
    a[0] = a[1] = d;
    b[0] = b[1] = m;
  }
}

// The int8 mode's factors of sub-block `sub`: the weight scale of each half (d, or d * sc) and
// the min term's factor (Q4_1 m, Q4_K -dmin * mn; 0 for the others).
template <QType Q>
STAGEWISE_ALWAYS_INLINE void sub_scales(float d, float m, const uint8_t* blk, int sub, float* scale, float* min) {
  float b[2];
  sub_factors<Q>(d, m, blk, sub, scale, b);
  *min = b[0];
}

// q[0, 32): the quants of sub-block `sub` (Q8_0: the int8 bits), without any offset.
template <QType Q>
STAGEWISE_ALWAYS_INLINE void sub_quants(const uint8_t* blk, int sub, uint8_t* q) {
  if constexpr (Q == QType::kQ8_0) {
    std::memcpy(q, blk + 2, 32);
  } else if constexpr (Q == QType::kQ4_0 || Q == QType::kQ4_1) {
    const uint8_t* qs = blk + (Q == QType::kQ4_1 ? 4 : 2);
    for (int i = 0; i < 16; ++i) {
      q[i] = qs[i] & 15;
      q[i + 16] = qs[i] >> 4;
    }
  } else if constexpr (Q == QType::kQ4_K) {
    const uint8_t* qs = blk + 16 + 32 * (sub / 2);
    const int shift = 4 * (sub % 2);
    for (int i = 0; i < 32; ++i) q[i] = (qs[i] >> shift) & 15;
  } else {  // Q6_K: weights 32 sub .. + 32 = 128 h + r with r = 32 (sub % 4) + i
    const int h = sub / 4, r0 = 32 * (sub % 4);
    const uint8_t* ql = blk + 64 * h + r0 % 64;
    const uint8_t* qh = blk + 128 + 32 * h;
    for (int i = 0; i < 32; ++i) {
      q[i] = static_cast<uint8_t>(((ql[i] >> (4 * (r0 / 64))) & 15) | (((qh[i] >> (2 * (r0 / 32))) & 3) << 4));
    }
  }
}

// The 32 exact float32 weights of sub-block `sub` (the scalar decoder: baseline ISA).
template <QType Q>
STAGEWISE_ALWAYS_INLINE void dequantize_sub_scalar(const uint8_t* blk, int sub, float* dst) {
  uint8_t q[32];
  float a[2], b[2];
  sub_quants<Q>(blk, sub, q);
  sub_factors<Q>(fp16_bits_at(blk + Block<Q>::kD), Block<Q>::kM >= 0 ? fp16_bits_at(blk + Block<Q>::kM) : 0.f, blk,
                 sub, a, b);
  for (int i = 0; i < 32; ++i) {
    const int32_t qi = Q == QType::kQ8_0 ? static_cast<int8_t>(q[i]) : static_cast<int32_t>(q[i]) - Block<Q>::kOffset;
    dst[i] = static_cast<float>(qi) * a[i / 16] + b[i / 16];
  }
}

}  // namespace stagewise::cpu
