// Linear layers over GGUF block-quantised weights: out = x @ dequant(W).T + bias.
//
// Weight layout (llama.cpp / GGUF, ggml-common.h): each row of W [out, in] is a run of blocks
// stored back to back. All scales are little-endian IEEE half (fp16) unless said otherwise.
//   Q4_0 (32 weights, 18 bytes): fp16 d, 16 bytes qs;  w[i] = d * (q[i] - 8)
//   Q4_1 (32 weights, 20 bytes): fp16 d, fp16 m, 16 bytes qs;  w[i] = d * q[i] + m
//   Q8_0 (32 weights, 34 bytes): fp16 d, 32 int8 qs;  w[i] = d * qs[i]
//     where for the 4-bit types q[i] = qs[i] & 15 and q[i + 16] = qs[i] >> 4 (i < 16).
//   Q4_K (256 weights, 144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins
//     mn[8], 128 bytes qs. Sub-block j (weights 32j .. 32j + 31) is the low (j even) or high
//     (j odd) nibbles of qs[32 (j / 2) .. + 32]; w = (d * sc[j]) * q - dmin * mn[j]. The 12
//     bytes s[] hold, for j < 4: sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63; for j >= 4:
//     sc[j] = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4, mn[j] = (s[j + 4] >> 4) | (s[j] >> 6) << 4.
//   Q6_K (256 weights, 210 bytes): ql[128], qh[64], int8 scales sc[16], fp16 d (last). Weight
//     i = 128 h + r (h < 2, r < 128): q = (ql[64 h + r % 64] >> 4 (r / 64)) & 15
//     | ((qh[32 h + r % 32] >> 2 (r / 32)) & 3) << 4;  w = (d * sc[i / 16]) * (q - 32).
// A "sub-block" below is 32 weights: a whole block of the first three types, an eighth of a
// K-quant super-block.
//
// Maths and rounding (exact mode, quant_linear): every weight is its exact float32
// dequantised value, that of gguf.quants.dequantize: d * q is exact in float32 (an 11-bit by
// 8-bit product), so Q4_1's "+ m" rounds once; for Q4_K, d * sc, dmin * mn and (d * sc) * q
// are exact and the difference rounds once; for Q6_K d * sc is exact and the product with
// q - 32 rounds once. Products are summed in float32 (the order is the kernel's own); the
// bias (in x's dtype) is added in float32 and the sum is rounded once to x's dtype on store.
//
// quant_linear_int8, the reduced-precision mode (approximate, llama.cpp's CPU scheme): each
// block of 32 values of a row of x (as float32) is quantised to int8,
//   d_x = max|x| / 127 (float32),  q_x = round_half_even(x * (1 / d_x))  (q_x = 0 when d_x = 0),
// and each sub-block of W meets the block of x it covers in exact integer arithmetic:
//   Q8_0: d * d_x * sum(q * q_x)      Q4_0: d * d_x * sum((q - 8) * q_x)
//   Q4_1: d * d_x * sum(q * q_x) + m * (d_x * sum(q_x))
//   Q4_K: (d * sc) * d_x * sum(q * q_x) - (dmin * mn) * (d_x * sum(q_x))
//   Q6_K: d * d_x * (sc[2b] * sum_lo((q - 32) * q_x) + sc[2b + 1] * sum_hi((q - 32) * q_x))
//         (sum_lo / sum_hi: the first and second 16 weights of the sub-block)
// (products of two scales and d_x * sum(q_x) rounded to float32 once); sub-block results are
// summed in float32 in the kernel's order, then bias and rounding as above. Against the exact
// op the error is that of x's quantisation: at most d_x / 2 per value of x.
#pragma once
#include "stagewise/common.h"

namespace stagewise {

// GGML tensor type ids (ggml.h `enum ggml_type`), the block types the ops accept.
enum class QType : int32_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

inline constexpr int64_t kQuantBlock = 32;  // weights per sub-block, and per x block of the int8 mode

#if defined(__CUDACC__)
#define STAGEWISE_QUANT_HD __host__ __device__
#else
#define STAGEWISE_QUANT_HD
#endif

// Bytes of one block of `t`; 0 for a type the ops do not know.
STAGEWISE_QUANT_HD inline constexpr int64_t quant_block_bytes(QType t) {
  return t == QType::kQ4_0 ? 18 : t == QType::kQ4_1 ? 20 : t == QType::kQ8_0 ? 34
       : t == QType::kQ4_K ? 144 : t == QType::kQ6_K ? 210 : 0;
}

// Weights in one block of `t` (in_features must be a multiple): 32, or 256 for the K-quants.
STAGEWISE_QUANT_HD inline constexpr int64_t quant_block_weights(QType t) {
  return t == QType::kQ4_K || t == QType::kQ6_K ? 256 : 32;
}

// The 6-bit scale (sc) and min (mn) of sub-block j < 8 of a Q4_K super-block's 12 scale bytes s.
STAGEWISE_QUANT_HD inline void q4_k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

struct QuantLinearParams {
  void* out;                  // [rows, out_features], row stride out_row_stride (elements), dtype
  int64_t out_row_stride;
  const void* x;              // [rows, in_features], row stride x_row_stride (elements), dtype
  int64_t x_row_stride;
  // quant_linear: the GGUF rows [out_features, in_features / block weights * block bytes];
  // quant_linear_int8: the same packed in panels of 16 rows (csrc/cpu/quant_pack.h),
  // [ceil(out_features / 16), in_features / block weights * record bytes]. Contiguous.
  const uint8_t* qweight;
  const void* bias;           // [out_features] contiguous, dtype; nullptr: no bias
  DType dtype;                // of out, x and bias
  QType qtype;
  int64_t rows;
  int64_t in_features;        // a multiple of quant_block_weights(qtype)
  int64_t out_features;
};

namespace cpu {
void quant_linear(const QuantLinearParams& p);
void quant_linear_int8(const QuantLinearParams& p);
// packed [ceil(rows / 16), in_features / block weights * record bytes] = the GGUF rows
// qweight [rows, ...] regrouped for quant_linear_int8 (csrc/cpu/quant_pack.h).
void quant_pack_int8(const uint8_t* qweight, QType qtype, int64_t rows, int64_t in_features, uint8_t* packed);
}  // namespace cpu

#ifdef STAGEWISE_HAS_CUDA_DECLS
namespace cuda {
cudaError_t quant_linear(const QuantLinearParams& p, cudaStream_t stream);
}  // namespace cuda
#endif

}  // namespace stagewise
